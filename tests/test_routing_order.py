"""--order routing: a window's lines grouped by their routing. A job whose lines fall into four
routing clusters (chosen by transformers' own router) ends up grouped, and every line's tokens
are still transformers'."""
import torch

from conftest import reference_tokens_of, token_routed_model
from klotski.assemble import open_engine
from klotski.config import RunConfig
from klotski.io.checkpoint import Checkpoint
from klotski.io.requests import Request
from placement.placement import Placement



def _clusters(model, count=4, size=6):
    """`count` sets of `size` token ids, each set's tokens picking the same two experts at the
    first layer, by transformers' own router over their embeddings."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.arange(3, hf.config.vocab_size)[None]
    with torch.no_grad():
        logits = hf(ids, output_router_logits=True).router_logits[0].reshape(ids.shape[1], -1)
    pairs = torch.topk(logits, 2).indices.sort(dim=1).values.tolist()
    by_pair = {}
    for token, pair in zip(ids[0].tolist(), pairs):
        by_pair.setdefault(tuple(pair), []).append(token)
    chosen, used = [], set()
    for pair, tokens in sorted(by_pair.items(), key=lambda kv: -len(kv[1])):
        if len(tokens) >= size and not used & set(pair):
            chosen.append(tokens[:size])
            used |= set(pair)
        if len(chosen) == count:
            return chosen
    raise AssertionError("the random model has too few disjoint expert pairs")


def _run(model, id_lists, order):
    """Every line's tokens, and the lines of each batch the run prefilled (by line index)."""
    cfg = RunConfig(model=str(model), progress=False, dtype="float32", batch_size=2, num_batches=2,
                    order=order, prefetch="none")
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=(tuple(x),), messages=None, max_new_tokens=3)
            for i, x in enumerate(id_lists)]
    # bs and n given and every group on the device: no plan, no profile to measure
    placement = Placement.by_kind(Checkpoint.open(str(model)).spec.group_keys(), kv="device")
    engine, seqs, errors = open_engine(cfg, reqs, placement=placement)
    assert not errors
    line_of = {tuple(x): i for i, x in enumerate(id_lists)}
    prefilled, forward = [], engine.pipeline.forward

    def recording(kvs, inputs):
        for inp in inputs:
            if inp.ids.shape[1] > 1:  # a prefill batch: its rows' whole prompts (no padding: one length)
                prefilled.append({line_of[tuple(row)] for row in inp.ids.tolist()})
        return forward(kvs, inputs)
    engine.pipeline.forward = recording
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(id_lists))], prefilled


def test_routing_order_groups_the_clusters_and_keeps_every_lines_tokens(tmp_path):
    model = token_routed_model(tmp_path / "token-routed")
    clusters = _clusters(model)
    # interleaved in the file, all of one length (the length order is the file's order); each
    # line a rotation of its cluster's tokens
    id_lists = [clusters[c][i:] + clusters[c][:i] for i in range(4) for c in range(4)]
    cluster = [i % 4 for i in range(len(id_lists))]
    file_order, mixed = _run(model, id_lists, "length")
    grouped, batches = _run(model, id_lists, "routing")
    reference = reference_tokens_of(model, id_lists, max_new_tokens=3)
    assert grouped == reference and file_order == reference
    assert sorted(i for b in batches for i in b) == list(range(len(id_lists)))  # each line prefilled once
    assert all(len({cluster[i] for i in b}) == 1 for b in batches), batches  # of one cluster each
    assert all(len({cluster[i] for i in b}) > 1 for b in mixed), mixed  # the file's order mixes them
