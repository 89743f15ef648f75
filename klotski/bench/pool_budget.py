"""The least device budget a run's plan gives one slot of the expert pool: the budget the pool's
tests (`tests/test_expert_pool.py`) and `benchmarks/pool_ops.py` stream experts through."""
from __future__ import annotations


def pool_minimum_budget(config, requests, placement) -> int:
    """The least device budget (to a KiB) whose planned working set in its "minimum" mode, beside
    the exact resident bytes of `placement`, holds one slot of the expert pool
    (planning.expert_pool_slots), for `requests` run as `config` fixes them (bs and n given)."""
    import dataclasses

    from klotski import planning
    from klotski.io.checkpoint import Checkpoint
    from klotski.schedule.sequences import prepare
    from placement.tiers import detect_budgets

    ckpt = Checkpoint.open(config.model)
    seqs, _ = prepare(requests, ckpt.tokenizer, ckpt.spec, config)
    budgets = detect_budgets("cpu", None, None)
    dtype = ckpt.compute_dtype(config.dtype)
    kw = dict(bs=config.batch_size, n=config.num_batches, chunk=config.prefill_chunk,
              longest_prompt=max(len(s.prompt_ids) for s in seqs), gen_len=max(s.max_new_tokens for s in seqs))

    def holds_a_slot(b: int) -> bool:
        return planning.expert_pool_slots(config, ckpt, dtype, dataclasses.replace(budgets, device=b), placement,
                                          **kw) > 0
    lo, hi = 0, 1 << 20
    while not holds_a_slot(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds_a_slot(mid) else (mid, hi)
    ckpt.close()
    return -(-hi // 1024) * 1024
