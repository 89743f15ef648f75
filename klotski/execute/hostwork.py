"""Host compute as a step runs it (hostcompute.py decides where; pipeline.py decides when): a
batch's attention beside its host KV cache, and an expert where its group lives in host RAM.
Activations go down on the KV store channel (after the compute that made them) and come up
on their own channel, so an emulated link charges them like any transfer; they are waited
for at once: host compute needs them now. Host work is timed by
the host clock on its own trace lane (on CUDA too: no stream runs it)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from klotski.execute.channels import DEVICE_TO_HOST, HOST_TO_DEVICE
from klotski.execute.experts import LayerExperts, run_expert
from klotski.execute.hostcompute import HostCompute
from klotski.execute.kvcache import BatchKV
from planner.workingset import ATTENTION_SCORE_CHUNK


class HostWork:
    """`wait(ticket, name)` is the pipeline's: a wait on the link counts as bubble."""

    def __init__(self, host: HostCompute, channels, trace, wait):
        self.host, self.ch, self.trace, self.wait = host, channels, trace, wait

    def attention(self, family, spec, layer: int, k: int, h, w: dict, ctx, kv: BatchKV, **prefix):
        """Batch k's attention with its KV cache on the host, computed there: the projections
        run where the weights are; the new keys/values go straight into the host cache and q
        follows them down; the attention core runs on the host over the host cache; the output
        comes back up. Nothing of the prefix crosses the link; a shared prompt prefix
        (`prefix`, its host keys/values) is read where it lives too."""
        if layer in kv.stored:  # an earlier step's store of this layer writes beside the new slots,
            self.wait(kv.stored[layer], "kv_store")  # and the host reads them: landed, not only queued
            kv.landed(layer)
        cos, sin, _, host_masks = ctx
        name = f"{layer}.b{k}"
        counts = self.host.attention

        device = DeviceSpan(self.trace, f"attn.{layer}.b{k}")

        def write_home(kk, vv):
            with device.off():
                kk, vv = self.ship([kk, vv], DEVICE_TO_HOST, f"kv.{name}")
                return kv.write(layer, kk, vv)

        def at_host(attend):
            def run(q, keys, values, mask, **extra):
                with device.off():
                    (q,) = self.ship([q], DEVICE_TO_HOST, f"q.{name}")
                    extra = {n: t.to(keys.device) for n, t in extra.items()}  # per-head constants (sinks)
                    with self.span(counts, f"attn.{name}"):
                        out = attend(q, keys, values, mask.to(keys.device), **extra)
                    return self.ship([out], HOST_TO_DEVICE, f"attn_out.{name}")[0]
            return run

        counts.on_host += 1
        counts.bytes_not_moved += kv.prefix_nbytes()
        with device:
            return family.attention_block(h, w, cos, sin, host_masks[spec.window(layer)], write_home, spec,
                                          max_scores=ATTENTION_SCORE_CHUNK, attend_at=at_host, **prefix)

    def expert(self, cache, key, moe: LayerExperts, picks, expert_ffn) -> None:
        """One expert computed where it lives: its tokens of every batch go down, the outputs
        come up into the same top-k slots, so the result is bit for bit the device path's."""
        name = f"{key[1]}.{key[2]}"
        with DeviceSpan(self.trace, f"expert.{name}") as device:
            x = moe.inputs(picks)
            with device.off():
                (x,) = self.ship([x], DEVICE_TO_HOST, f"x.{name}")
                with self.span(self.host.experts, f"expert.{name}"):
                    w = cache.host_weights(key)  # decoded here when packed
                    y = run_expert(expert_ffn, x, w)
                    del w
                    cache.drop_host_weights(key)
                (y,) = self.ship([y], HOST_TO_DEVICE, f"y.{name}")
            moe.put(picks, y)
        self.host.experts.on_host += 1
        self.host.experts.bytes_not_moved += cache.moved[key]

    def ship(self, tensors: list, link: str, name: str) -> list:
        """Activations across the link, waited for."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if link == DEVICE_TO_HOST:
            ticket = self.ch["kv_store"].submit(lambda: [t.to("cpu") for t in tensors], name=name, nbytes=nbytes,
                                                link=DEVICE_TO_HOST, after_compute=True, reads=tensors)
        else:  # on their own channel: behind KV loads they would wait for what they do not need
            channel = self.ch["activations"]
            ticket = channel.submit(lambda: [channel.to_device(t, owned=True) for t in tensors], name=name,
                                    nbytes=nbytes, link=HOST_TO_DEVICE)
        return self.wait(ticket, name)

    @contextmanager
    def span(self, counts, name: str):
        """Host compute, timed by the host clock on its own lane, added to `counts`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            counts.host_s += end - start
            self.trace.add("host", name, start, end)


class DeviceSpan:
    """A compute span that leaves out the host work inside it (`with span.off(): ...`): on
    CUDA the device stands idle while the host computes and activations cross, and that time
    is bubble, not compute. On a CPU the host is the device: one span throughout."""

    def __init__(self, trace, name: str):
        self.trace, self.name, self._open = trace, name, None

    def __enter__(self):
        self._open = self.trace.span("compute", self.name)
        self._open.__enter__()
        return self

    def __exit__(self, *exc):
        self._open.__exit__(*exc)

    @contextmanager
    def off(self):
        if not self.trace.cuda:
            yield
            return
        self._open.__exit__(None, None, None)
        try:
            yield
        finally:
            self._open = self.trace.span("compute", self.name)
            self._open.__enter__()
