"""The recipes that ship with replicafit (``*.yaml`` beside this file).

Installed as ``replicafit.recipes`` so that ``replicafit fit digits_mlp`` finds them by
name from any directory; ``replicafit list recipes`` shows them with the first comment line
of each file as its description. From a checkout, ``replicafit fit recipes/digits_mlp.yaml``
reads the same file by its path.
"""
