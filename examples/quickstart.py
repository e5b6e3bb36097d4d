"""Quick start: MirroredStrategy on two logical CPUs.

1. The seed's pattern: inside ``strategy.run``, each replica hands its gradient to
   ``merge_call``; ``merge_fn`` reduces them with ``batch_reduce_to`` and applies the
   sum with ``extended.update``: every copy of the mirrored variable becomes 2.0.
2. A distributed computation reduced with ``strategy.reduce``: the mean squared value
   over a global batch split unevenly across the replicas.

Run: python examples/quickstart.py
"""

import torch

import replicafit.strategies as ds


def main() -> None:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    print(f"{strategy} with {strategy.num_replicas_in_sync} replicas")

    with strategy.scope():
        v = ds.Variable(1.0, name="v")

    def merge_fn(strategy, grad):
        # One batched reduction for all (value, destination) pairs, then one update per copy.
        (reduced,) = strategy.extended.batch_reduce_to(ds.ReduceOp.SUM, [(grad, v)])
        return strategy.extended.update(v, lambda copy, total: copy.assign(total), args=(reduced,))

    def replica_fn():
        grad = torch.tensor(1.0)  # each replica's "gradient"
        return ds.get_replica_context().merge_call(merge_fn, args=(grad,))

    strategy.run(replica_fn)
    print("mirrored variable after merge_call/batch_reduce_to/update:")
    print(v)
    assert [float(c) for c in v.values] == [2.0, 2.0]

    # A global batch of 5 rows: the split rule gives replica 0 three rows, replica 1 two.
    batches = [torch.arange(5, dtype=torch.float32)]
    for batch in strategy.experimental_distribute_dataset(batches):
        squares = strategy.run(lambda x: x * x, args=(batch,))
        print("per-replica squares:", strategy.experimental_local_results(squares))
        mean = strategy.reduce("MEAN", squares, axis=0)
        print(f"reduce(MEAN, axis=0) = {mean.item():.1f}  (= (0+1+4+9+16) / 5)")
        assert mean.item() == 6.0


if __name__ == "__main__":
    main()
