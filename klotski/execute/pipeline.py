"""The schedule (Algorithm 1 of the Klotski paper): the order in which one forward step of a
batch group computes, and which transfers it starts when.

A step takes every batch of the group through the model layer by layer. Per layer:

  1. attention, batch by batch; with the KV cache on the host, batch k+1's KV is loaded
     (`kv_load`) while batch k computes and batch k's new KV is stored behind (`kv_store`);
     meanwhile `weights` prefetches this layer's gate and K hot experts;
  2. the gate, once over every batch's tokens; every selected expert that is neither on the
     device nor on its way is queued on `experts` at once;
  3. experts over the tokens of *all* batches in waves (experts.py: a handful of kernels a
     wave, whatever the number of batches or experts): the layer's resident experts in one
     grouped call over their stack, then every transferred expert that has landed (in its slot
     of the one expert pool: one call over the pool), waiting only when none has; each wave's experts released the moment it is done; `weights`
     starts on the next layer's attention as soon as there is room (residency.py keeps the
     wanted transfers and evicts).

Host compute (klotski/execute/hostcompute.py decides, per layer and step; hostwork.py runs it):
a batch whose KV cache is on the host may attend there (q down, the output up; no KV load),
and a cold expert whose group is in host RAM may be computed there (its tokens down, the
outputs up; no transfer).

Variants for ablation (`RunConfig.schedule`): `simple` (one batch, whole next layer
prefetched), `multibatch` (n batches, whole next layer: FlexGen style), `hot-prefetch`
(gate + K hot experts, the rest on demand, id order), `klotski` (+ hot-first order and early
release). All compute the same numbers; only order and overlap differ.

This module orders work and calls the model math (the family's hooks, experts.py's tensor
work); it never does arithmetic on weights and touches them only through the WeightCache.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from klotski.models import layers as L
from klotski.models.grouped import runs_grouped
from klotski.execute.staging import HostReads, SmallUploads
from klotski.execute.contract import StepInput, StepOutput
from klotski.execute.experts import LayerExperts, SortKeys, first_broken, real_tokens, route_group
from klotski.execute.gating import AdaptiveGating, exact_ids
from klotski.execute.hostcompute import HostCompute
from klotski.execute.hostwork import HostWork
from klotski.execute.kvcache import BatchKV
from klotski.execute.residency import Residency
from klotski.execute.segments import SharedLayer, joined
from placement.tiers import DEVICE
from planner.workingset import ATTENTION_SCORE_CHUNK, DISK_WINDOW_LAYERS, KV_BUFFERS, Step, activation_bytes

# steps whose routing a pipeline that predicts nothing holds before its predictor learns it
# (`learn`), and the most routing ids it holds (8 MiB of int64: prefill steps' many tokens learn sooner)
LESSON_STEPS = 64
LESSON_IDS = 1 << 20


class Pipeline:
    def __init__(self, spec, cache, channels, config, trace, predictor, memory, device, host: HostCompute | None = None,
                 uploads: SmallUploads | None = None, reads: HostReads | None = None):
        self.spec, self.cache, self.ch, self.config = spec, cache, channels, config
        self.host = host or HostCompute.from_config(config)
        self.host_attention_ok = spec.family.HOST_ATTENTION
        self.host_experts: set = set()  # this layer's experts computed where they live
        self.M = spec.family  # the model's layer functions
        self.trace, self.predictor, self.memory, self.device = trace, predictor, memory, device
        self.res = Residency(cache, channels, memory, trace)
        # a step's small host tensors (ids, masks, RoPE tables, a wave's rows) go up through one pinned ring
        self.uploads = uploads or SmallUploads(device)
        # the routing ids come down through a pinned ring, non-blocking, an event each
        self.reads = reads or HostReads(device)
        self._sort_keys: dict = {}  # layer -> SortKeys (its resident experts first), made once
        self.host_work = HostWork(self.host, channels, trace, self.res.wait)
        self.schedule = config.schedule
        self.whole_layer = self.schedule in ("simple", "multibatch")
        # hot experts predicted a layer: none where every expert is resident (nothing to move); the
        # routing is still learnt (the saved table places a later run's experts: prefetch/correlate.py),
        # then in bulk: a step's routing ids are held (`lessons`) until `learn`
        off_device = any(k[0] == "expert" and t != DEVICE for k, t in cache.placement.tiers.items())
        self.K = 0 if config.prefetch == "none" or not off_device else \
            spec.shape.top_k if config.hot_experts is None else config.hot_experts
        self.next_gate = hasattr(predictor, "speculate")
        # --prefetch pregate: maps fitted on the run, their accumulators on the device, charged
        self.pregate = getattr(predictor, "maps", None)
        if self.pregate is not None:  # (the run was planned for the budget less these bytes)
            self.memory.reserve(self.pregate.place(device), "the pre-gate's maps")
        self._features: dict = {}  # MoE layer -> (pre-gate features of the layer before's input, bytes)
        self.keeps: list = []      # this step's batches' real tokens (None: all)
        # distinct experts a MoE layer's routing chose, and the layer-steps, in steps where every
        # row decodes one token ("decode") and in the others ("prefill"): --order's measure
        self.decoding = False
        self.distinct = {"decode": [0, 0], "prefill": [0, 0]}
        self.window = DISK_WINDOW_LAYERS  # disk->host staging, layers ahead (paper §6.1's L)
        self.kv_ahead = None      # (layer, load) of batch 0's host KV, issued during the layer before
        self.at_host: list = []   # this step's batches whose attention runs beside their host KV
        self.layouts: list = []   # this step's batches' shared segments (schedule/prefix.py)
        self.valids: list = []    # this step's batches' token validity, on the device (linear layers read it)
        self.on_layer = None     # optional callback(layer, hidden states per batch), for tests
        self.gating: AdaptiveGating | None = None  # --adaptive-gating, once calibrated (schedule/gating.py)
        self.kv_bytes_loaded = 0  # host->device KV bytes loads moved (a shared prefix's once per layer)
        # (token, expert) picks per MoE layer and expert, as routed: the job's routing, for the replay
        moe_layers = sum(spec.shape.experts_in(j) > 0 for j in range(spec.shape.num_layers))
        self.routed = np.zeros((moe_layers, spec.shape.num_experts), dtype=np.int64)
        self.lessons: list[dict] = []   # per step held back: MoE layer -> its routing ids (K == 0)
        self._step_lessons: dict = {}   # this step's, held back once the step is whole
        self._lesson_ids = 0            # routing ids held in `lessons`

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, kvs: list[BatchKV], inputs: list[StepInput]) -> list[StepOutput]:
        """Run one step for the group; return each batch's next-token logits and where, if
        anywhere, its hidden states stopped being finite."""
        spec = self.spec
        self.predictor.begin_step()
        self.trace.begin_step()  # timed or not (one step in RunConfig.time_every)
        # where each batch's attention runs this step, decided once: the activation reserve
        # depends on it (a host batch's keys and scores stay on the host)
        self.at_host = [self._attend_on_host(kv, inp.ids.shape[1]) for kv, inp in zip(kvs, inputs)]
        # the shared segments each batch's computed rows start from, side by side in its attention
        self.layouts = [kv.segments() for kv in kvs]
        act = self._activation_bytes(kvs, inputs)
        self.res.make_room(act, "activations")
        self.memory.reserve(act, "activations")
        hs, ctx, keeps = [], [], []
        # a linear layer's pads are identity steps for its state: it reads the step's validity
        self.valids = [self.uploads(inp.valid) for inp in inputs] if spec.shape.linear_layers else []
        windows = {spec.window(j) for j in range(spec.shape.num_layers)}  # one mask per distinct window
        for kv, inp in zip(kvs, inputs):
            with self.trace.span("compute", "embed"):
                # gathered where the table lives; only the rows travel
                rows, index = self.cache.embedding_rows(inp.ids)
                h = self.uploads(L.embed(self.uploads(index) if rows.is_cuda else index, rows))
                cos, sin = L.rope_tables(inp.positions, spec.rope_inv_freq, spec.rope_attention_scaling, h.dtype)
                sink, recent = self.config.attention_sink, self.config.attention_recent
                valid = kv.begin_step(inp.valid, sink, recent)
                masks = {w: L.attention_mask(valid, inp.ids.shape[1], w, sink, recent) for w in windows}
                columns = kv.step_columns()  # masks are built on the host, moved once
                if columns is not None:  # attend over the kept slots only
                    masks = {w: m.index_select(-1, columns) for w, m in masks.items()}
                masks = kv.with_prefix_columns(masks, inp.ids.shape[1])  # rows that do not read it: masked
            hs.append(h)
            keep = real_tokens(inp.valid)
            keeps.append(None if keep is None else self.uploads(keep))
            ctx.append((self.uploads(cos), self.uploads(sin), {w: self.uploads(m) for w, m in masks.items()}, masks))
        self.keeps = keeps
        self.decoding = all(inp.ids.shape[1] == 1 for inp in inputs)
        broken = [torch.full((h.shape[0],), -1, device=h.device) for h in hs]
        for layer in range(self.window):  # already staged by the previous step, except on the first
            self.cache.stage(self._layer_keys(layer))
        for layer in range(spec.shape.num_layers):
            self.res.layer, self.res.upcoming = layer, {}
            # Wraps to the next step's first layers, so the disk never idles between steps (on the
            # last step of a run that is one window read for nothing).
            self.cache.stage(self._layer_keys((layer + self.window) % spec.shape.num_layers))
            self._attention(layer, hs, ctx, kvs)
            moe, hot = self._gates(layer, hs, keeps)
            self._load_kv_ahead(layer + 1, kvs)
            hs = self._experts(layer, hs, moe, hot)
            broken = [first_broken(b, layer, h) for b, h in zip(broken, hs)]
            if self.on_layer:
                self.on_layer(layer, hs)
            self.cache.unstage(self._layer_keys(layer))
        assert self.kv_ahead is None, "a KV load issued ahead was never used"
        for _, nbytes in self._features.values():  # (none: every MoE layer's gate learned from its own)
            self.memory.free(nbytes)
        self._features = {}
        for kv in kvs:
            kv.end_step()
        head = self.res.get(("head",))
        with self.trace.span("compute", "lm_head"):
            out = [StepOutput(L.logits(h[:, -1], head["norm"], head["lm_head"], spec.rms_norm_eps,
                                          spec.norm_offset).cpu(), b.cpu())
                   for h, b in zip(hs, broken)]
        self.cache.release(("head",))
        self.memory.free(act)
        if self._step_lessons:
            self.lessons.append(self._step_lessons)
            self._lesson_ids += sum(ids.numel() for ids in self._step_lessons.values())
            self._step_lessons = {}
            if len(self.lessons) >= LESSON_STEPS or self._lesson_ids >= LESSON_IDS:
                self.learn()
        return out

    def learn(self) -> None:
        """The predictor learns the routing of the steps held back (`lessons`: every expert
        resident, so nothing predicted meanwhile) in one pass: each MoE layer's ids of those steps
        side by side as the rows of one step (its tables pair a token's layers row by row, and
        every step routes its tokens through every MoE layer). What it counts is what learning
        step by step counts; its report's distinct experts a layer-step are counted per pass."""
        if not self.lessons:
            return
        steps, self.lessons, self._lesson_ids = self.lessons, [], 0
        self.predictor.begin_step()
        for layer in sorted(steps[0]):
            self.predictor.observe(layer, [torch.cat([step[layer] for step in steps])])

    # ---- attention ----------------------------------------------------------------------
    def _attention(self, layer, hs, ctx, kvs):
        pregated = self._pregate_ahead(layer, hs)
        if self.whole_layer:
            self.res.want([("gate", layer)] + self._expert_keys(layer), "weights")
            last = layer + 1 == self.spec.shape.num_layers
            self.res.want([("head",)] if last else self._layer_keys(layer + 1), "weights")
        else:
            hot = self._predict(layer)
            ahead = [("gate", layer + 1)] if self.next_gate and layer + 1 < self.spec.shape.num_layers else []
            self.res.want([("gate", layer)] + [("expert", layer, e) for e in hot] + ahead, "weights")
        w = self.res.get(("attn", layer))
        if self.spec.shape.is_linear(layer):
            self._recurrent(layer, hs, w, kvs)
            self._want_pregated(layer, pregated)
            return
        loads, stores = {}, []
        at_host = self.at_host
        moves = [kv.on_host and not h for kv, h in zip(kvs, at_host)]  # whose KV prefix comes up
        shared = self._shared_prefix(layer, kvs)
        if moves[0]:
            ahead, self.kv_ahead = self.kv_ahead, None
            loads[0] = ahead[1] if ahead and ahead[0] == layer else self._kv_load(kvs[0], layer)
        for k, kv in enumerate(kvs):
            if k + 1 < len(kvs) and moves[k + 1]:
                # at most KV_BUFFERS batches on the device: the oldest store lands before the
                # next batch's KV loads (behind this batch's compute)
                while len(stores) > KV_BUFFERS - 2:
                    self._kv_stored(*stores.pop(0))
                loads[k + 1] = self._kv_load(kvs[k + 1], layer)
            # the batch's rows start from shared segments: their keys, read once for every row
            layout = self.layouts[k]
            prefix = {} if not layout else {
                "prefix": joined([p.layer(layer) for p in layout]) if at_host[k] else shared.get(layout)}
            if at_host[k]:
                hs[k] = self.host_work.attention(self.M, self.spec, layer, k, hs[k], w, ctx[k], kv, **prefix)
                continue
            buf = None
            if kv.on_host:
                buf = self.res.wait(loads[k][0], f"kv.{layer}.{k}")
            cos, sin, masks, _ = ctx[k]
            mask = masks[self.spec.window(layer)]
            with self.trace.span("compute", f"attn.{layer}.b{k}"):
                hs[k] = self.M.attention_block(hs[k], w, cos, sin, mask,
                                          lambda kk, vv, kv=kv, buf=buf: kv.write(layer, kk, vv, buf), self.spec,
                                          max_scores=ATTENTION_SCORE_CHUNK, **prefix)
            if kv.on_host:
                # a device->host copy of what this attention just wrote: after the compute queued so far
                kv.stored[layer] = self.ch["kv_store"].submit(
                    lambda kv=kv, buf=buf: kv.store(layer, buf), name=f"kv.{layer}.{k}", nbytes=kv.new_nbytes(),
                    link="device_to_host", after_compute=True, reads=buf[:2])
                stores.append((kv.stored[layer], loads[k][1]))
        for ticket, nbytes in stores:  # sync(store_cache_stream) before the buffers go
            self._kv_stored(ticket, nbytes)
        shared.release()
        self.cache.release(("attn", layer))
        self._want_pregated(layer, pregated)
        self.res.pump()

    def _want_pregated(self, layer, pregated) -> None:
        """The next layer's hot experts by the pre-gate's picks (`pregated`, a Read or None), wanted
        now: a layer ahead, this layer's attention already queued."""
        if pregated is not None:
            self.predictor.pregated(self.spec.shape.moe_index(layer + 1), [pregated.wait()])
            self.res.want([("expert", layer + 1, e) for e in self._predict(layer + 1)], "weights")

    def _pregate_ahead(self, layer, hs):
        """--prefetch pregate: the next MoE layer's picks by its fitted map from this layer's input,
        before this layer's attention (next-gate speculation has them only after its gate), on
        their way to the host; the features kept until that layer's gate learns from them. None
        where the next layer has no experts, its map is not fitted yet, or the features do not
        fit in the device budget (the correlation table predicts then)."""
        nxt = layer + 1
        if self.pregate is None or nxt >= self.spec.shape.num_layers or not self.spec.shape.experts_in(nxt):
            return None
        m = self.spec.shape.moe_index(nxt)
        tokens = sum(h.shape[0] * h.shape[1] if k is None else len(k) for h, k in zip(hs, self.keeps))
        nbytes = self.pregate.feature_nbytes(tokens)
        if not self.memory.fits(nbytes):
            return None
        self.memory.reserve(nbytes, f"pre-gate features of layer {layer}")
        with self.trace.span("compute", f"pregate.{nxt}"):
            feats = self.pregate.features(hs, self.keeps)
            picks = self.pregate.picks(m, feats, self.spec.shape.top_k) if self.pregate.fitted(m) else None
        self._features[m] = (feats, nbytes)
        return None if picks is None else self.reads(picks)

    def _recurrent(self, layer, hs, w, kvs) -> None:
        """A linear-attention layer (a hybrid's Gated DeltaNet): each batch's rows from their
        recurrent state (execute/recurrent.py), computed on the device. On the host tier the
        layer's state of the computed rows goes up on kv_load (the next batch's behind this
        one's compute) and back on kv_store after it, its room held until the store lands, as
        attention's keys and values move. Host attention does not apply: no keys to attend beside."""
        loads, stores = {}, []
        if kvs and kvs[0].state.on_host:
            loads[0] = self._state_load(kvs[0].state, layer, 0)
        for k, kv in enumerate(kvs):
            if k + 1 < len(kvs) and kvs[k + 1].state.on_host:
                while len(stores) > KV_BUFFERS - 2:  # at most KV_BUFFERS batches' states on the device
                    self._kv_stored(*stores.pop(0))
                loads[k + 1] = self._state_load(kvs[k + 1].state, layer, k + 1)
            state = kv.state
            rows = self.res.wait(loads[k][0], f"state.{layer}.{k}") if state.on_host else state.layer(layer)
            with self.trace.span("compute", f"linear.{layer}.b{k}"):
                hs[k], new = self.M.recurrent_block(hs[k], w, rows, self.valids[k], self.spec)
            del rows
            if state.on_host:
                state.stored[layer] = self.ch["kv_store"].submit(
                    lambda state=state, new=new: state.store(layer, new), name=f"state.{layer}.{k}",
                    nbytes=loads[k][1], link="device_to_host", after_compute=True, reads=new)
                stores.append((state.stored[layer], loads[k][1]))
            else:
                state.put(layer, new)
            del new
        for ticket, nbytes in stores:
            self._kv_stored(ticket, nbytes)
        self.cache.release(("attn", layer))
        self.res.pump()

    def _state_load(self, state, layer: int, k: int):
        """A host-tier recurrent state's rows of `layer` on their way up (after that layer's last
        store home): (ticket, bytes held on the device until the store back lands)."""
        nbytes = state.layer_nbytes()
        self.res.make_room(nbytes, "recurrent state")
        self.memory.reserve(nbytes, f"recurrent state layer {layer}")
        previous = [state.stored[layer]] if layer in state.stored else []
        ticket = self.ch["kv_load"].submit(lambda: state.load(layer, self.device), name=f"state.{layer}.{k}",
                                           nbytes=nbytes, after=previous)
        self.kv_bytes_loaded += nbytes
        return ticket, nbytes

    def _shared_prefix(self, layer: int, kvs) -> "SharedLayer":
        """Keys/values of `layer` of every shared segment the batches attending on the device
        read: on the device tier, views of the one copy; on the host, one load of each for the
        whole group (on kv_load, beside batch 0's), its room held until the layer's attention
        is done."""
        segments = list({id(p): p for k, layout in enumerate(self.layouts) if not self.at_host[k]
                         for p in layout}.values())
        if not segments or not segments[0].on_host:
            return SharedLayer(self.res, self.memory, {id(p): p.layer(layer) for p in segments})
        nbytes = sum(p.nbytes() for p in segments)
        self.res.make_room(nbytes, "kv prefix")
        self.memory.reserve(nbytes, f"kv prefix layer {layer}")
        self.kv_bytes_loaded += nbytes
        ticket = self.ch["kv_load"].submit(lambda: {id(p): p.load(layer, self.device) for p in segments},
                                           name=f"prefix.{layer}", nbytes=nbytes)
        return SharedLayer(self.res, self.memory, None, ticket, nbytes, f"prefix.{layer}")

    def always_host_attention(self) -> bool:
        """Every host-KV batch attends beside its cache (`--host-attention on`), as planned."""
        return self.host.attention_mode == "on" and self.host_attention_ok

    def _attend_on_host(self, kv: BatchKV, new: int) -> bool:
        """Batch `kv`'s attention beside its host cache this step, `new` tokens a row (its
        slots bounded by the cache's filled ones: decided before the step begins)."""
        if not (kv.on_host and self.host_attention_ok):
            return False
        return self.host.attend_on_host(kv.rows, kv.filled + new, new)

    def _kv_stored(self, ticket, nbytes: int) -> None:
        self.res.wait(ticket, "kv_store")
        self.memory.free(nbytes)

    def _load_kv_ahead(self, layer: int, kvs) -> None:
        """Batch 0's host KV for `layer`, on the link behind this layer's experts (asked for
        already) and beside their compute, as inequality (7) has it: waited for at the start
        of that layer's attention, it left the link idle while the device waited."""
        kv = kvs[0]
        # only into free room, evicting nothing (this layer's experts cost more than it hides),
        # and leaving room for one expert's use (fetched, decoded, its codec's temporaries): the
        # planner's minimum holds this KV or an expert, never both, and neither can be evicted
        if (layer < self.spec.shape.num_layers and not self.spec.shape.is_linear(layer) and kv.on_host
                and not self.at_host[0]
                and self.memory.fits(kv.step_nbytes() + self.cache.largest_use)):
            self.kv_ahead = (layer, self._kv_load(kv, layer))

    def _kv_load(self, kv: BatchKV, layer: int):
        nbytes = kv.step_nbytes()
        self.res.make_room(nbytes, "kv")
        self.memory.reserve(nbytes, f"kv layer {layer}")
        # it re-reads host slots the last step's store of this layer wrote
        previous = [kv.stored[layer]] if layer in kv.stored else []
        ticket = self.ch["kv_load"].submit(lambda: kv.load(layer, self.device), name=f"kv.{layer}",
                                           nbytes=kv.prefix_nbytes(), after=previous)
        self.kv_bytes_loaded += kv.prefix_nbytes()
        return ticket, nbytes

    # ---- gate ---------------------------------------------------------------------------
    def _gates(self, layer, hs, keeps):
        hot = self._predict(layer)
        gate = self.res.get(("gate", layer))
        with self.trace.span("compute", f"gate.{layer}"):
            routed = route_group(self.M, self.spec, hs, gate, keeps)
            if self.gating is not None and self.spec.shape.experts_in(layer):  # a post-routing step
                routed = self.gating.apply(routed, self.spec.shape.moe_index(layer), self.spec.shape.num_experts)
        # Every batch's expert ids start for the host at once (non-blocking; on CUDA an event
        # marks their arrival), and the next gate's picks likewise; then the resident experts'
        # wave is queued (its offsets counted on the device) before the host waits for the ids:
        # the device computes it while the host decides the transfers.
        read = self.reads(routed.experts)
        ahead = self._speculate(layer + 1, hs, keeps)
        stack = self.cache.stacks.get(layer)
        moe = LayerExperts(routed, self.spec.shape.top_k, self._keys(layer, stack))
        if stack is not None and runs_grouped(self.device.type, self.cache.dtype):
            self._resident_wave(layer, moe, stack)
        moe.count(read.wait(), self.spec.shape.num_experts)  # the layer's one wait for routing
        if self.gating is not None and self.spec.shape.experts_in(layer):
            self._count_skipped(layer, moe)
        self.host_experts = self._experts_on_host(layer, moe)
        held = self._features.pop(self.spec.shape.moe_index(layer), None) if self.spec.shape.experts_in(layer) else None
        if held is not None:  # the pre-gate learns this gate's scores from the layer before's input
            self.pregate.learn(self.spec.shape.moe_index(layer), held[0], routed.x, gate["router"])
            self.memory.free(held[1])
        self.res.want([("expert", layer, e) for e in moe.chosen if e not in self.host_experts], "experts", front=True)
        self.cache.release(("gate", layer))
        if self.spec.shape.experts_in(layer):
            # what the router chose: a pair adaptive gating skipped counts as chosen
            ids = moe.ids if self.gating is None else exact_ids(moe.ids, self.spec.shape.num_experts)
            if self.K:
                self.predictor.observe(self.spec.shape.moe_index(layer), [ids])
            else:  # nothing predicts: learnt later, with other steps' (`learn`)
                self._step_lessons[self.spec.shape.moe_index(layer)] = ids
            self.routed[self.spec.shape.moe_index(layer)] += moe.counts
            tally = self.distinct["decode" if self.decoding else "prefill"]
            tally[0] += len(moe.chosen)
            tally[1] += 1
        if ahead is not None:
            self.predictor.speculate(self.spec.shape.moe_index(layer + 1), [ahead.wait()])
        return moe, hot

    def _count_skipped(self, layer, moe: LayerExperts) -> None:
        """Adaptive gating's savings: the pairs it skipped, and the experts only those pairs
        wanted that are neither on the device nor on their way (a demand load not made)."""
        for e in self.gating.count(moe.ids, self.spec.shape.num_experts):
            key = ("expert", layer, int(e))
            if not self.cache.present(key):
                self.gating.not_loaded(self.cache.moved[key])  # the bytes a load moves over the link

    def _keys(self, layer, stack) -> SortKeys | None:
        """The layer's sort order, resident experts first (made once per layer)."""
        if stack is None:
            return None
        if layer not in self._sort_keys:
            self._sort_keys[layer] = SortKeys.of(stack.experts, self.spec.shape.experts_in(layer), self.uploads)
        return self._sort_keys[layer]

    def _resident_wave(self, layer, moe: LayerExperts, stack) -> None:
        with self.trace.span("compute", f"experts.{layer}.resident"):
            moe.resident_wave(self.M.bind_grouped_expert_ffn(self.spec), stack, self.uploads)

    def _experts_on_host(self, layer, moe: LayerExperts) -> set:
        """The selected experts computed where they live this step: not on the device nor on
        their way, their group in host RAM, and the host deciding (HostCompute)."""
        if self.host.experts_mode == "off" or not moe.chosen:
            return set()
        counts, chosen = moe.counts, moe.chosen
        out = set()
        for e in chosen:
            key = ("expert", layer, e)
            if self.cache.present(key) or not self.cache.host_copy_available(key):
                continue
            if self.host.expert_on_host(int(counts[e]), self.cache.placement.tiers[key]):
                out.add(e)
        for e in out:  # a prefetch not started yet is not wanted any more
            self.res.claim(("expert", layer, e))
        return out

    def _speculate(self, layer, hs, keeps):
        """Next-gate prediction: layer+1's router on the hidden states entering this MoE, only if
        that gate has already arrived (a prediction must never stall compute); its picks on their
        way to the host (a Read), or None."""
        if not self.next_gate or not self.K:
            return None
        key = ("gate", layer)
        if layer >= self.spec.shape.num_layers or not self.spec.shape.experts_in(layer) or not self.cache.ready(key):
            return None
        gate = self.cache.get(key)
        with self.trace.span("compute", f"speculate.{layer}"):
            picks = route_group(self.M, self.spec, hs, gate, keeps, shared=False).experts
        return self.reads(picks)

    # ---- experts ------------------------------------------------------------------------
    def _experts(self, layer, hs, moe: LayerExperts, hot):
        """The layer's experts in waves: the resident ones in one call over the layer's stack,
        then every transferred expert that has arrived, in one call each time, waiting only when
        none has; experts computed where they live run while the link is still busy."""
        if not self.whole_layer:
            self.res.want(self._next_layer_prefetch(layer), "weights")
        order = self._order(layer, moe.chosen, hot)
        # expected compute order, for choosing what to evict (needed last goes first)
        self.res.upcoming = {("expert", layer, e): i for i, e in enumerate(order)}
        stack = self.cache.stacks.get(layer)
        resident = [e for e in order if stack is not None and e in stack.row]
        moved = [e for e in order if e not in self.host_experts and (stack is None or e not in stack.row)]
        host = [e for e in order if e in self.host_experts]
        ffn = self.M.bind_grouped_expert_ffn(self.spec)
        if resident and not moe.resident_done:
            self._resident_wave(layer, moe, stack)
        for e in resident:
            self.res.upcoming.pop(("expert", layer, e))
        done, i = [], 0
        while i < len(moved) or host:
            ready = i
            while ready < len(moved) and self.cache.ready(("expert", layer, moved[ready])):
                ready += 1
            if ready == i and host:  # nothing has landed: compute where an expert lives meanwhile
                e = host.pop(0)
                self.res.upcoming.pop(("expert", layer, e))
                self.host_work.expert(self.cache, ("expert", layer, e), moe, moe.picks(e),
                                      self.M.bind_expert_ffn(self.spec))
                continue
            if ready == i:  # none yet: wait for the next to land (FIFO: it lands first), then look again
                self.res.get(("expert", layer, moved[i]), tensors=False)
                continue
            done += self._waves(layer, moe, ffn, moved[i:ready])
            i = ready
        # end of layer: free the rest, incl. unused prefetches
        self.cache.release_all(done + self._expert_keys(layer))
        self.res.pump()
        if self.gating is not None and self.gating.recording and self.spec.shape.experts_in(layer):
            self.gating.record(self.spec.shape.moe_index(layer), moe, hs)
        return moe.hidden_states(hs)

    def _waves(self, layer, moe: LayerExperts, ffn, experts: list[int]) -> list:
        """Transferred experts that have landed, computed together: every one in a pool slot
        (placement.pool) in one call over the pool's tensors, rows in slot order (-1: a slot not
        in this wave); the pool's overflow (WeightCache.start_many) in one call per Landing over
        its stacks; any other (moved alone: no slot nor room to stack it, or a disk read handed
        over on a CPU) in a call of its own. A packed expert is decoded when first waited for,
        with the experts moved beside it (into their slots, or their Landing's stacks). No weight
        is copied. Returns the keys kept to the end of the layer (non-klotski schedules)."""
        pooled, landed, alone = {}, {}, []
        for e in experts:
            key = ("expert", layer, e)
            landing = self.cache.landing(key)
            if self.cache.in_pool(key):
                pooled[key] = e
            elif landing is not None:
                landed.setdefault(landing, {})[key] = e
            else:
                alone.append((key, e))
        kept = []
        if pooled:
            for key in pooled:
                self.res.get(key, tensors=False)  # waited for (timed as bubble)
            kept += self._computed(moe, ffn, self.cache.pool.tensors, list(pooled), self.cache.pool.rows(pooled))
        for landing, members in landed.items():
            for key in members:
                self.res.get(key, tensors=False)
            rows = [-1] * len(landing.keys)
            for key, e in members.items():
                rows[landing.row[key]] = e
            kept += self._computed(moe, ffn, landing.stacks, list(members), rows)
        for key, e in alone:
            w = self.res.get(key)  # decoded into a copy of its own if packed
            kept += self._computed(moe, ffn, {n: t.unsqueeze(0) for n, t in w.items()}, [key], [e])
            del w  # no reference outlives its release
        return kept

    def _computed(self, moe: LayerExperts, ffn, w: dict, keys: list, rows: list) -> list:
        """One wave: `rows` (expert ids by row of w's stacked tensors, -1 for none) in one call;
        then its experts released (klotski) or kept, evictable, to the layer's end."""
        with self.trace.span("compute", f"experts.{keys[0][1]}." + ",".join(str(k[2]) for k in keys)):
            moe.run_wave(ffn, w, rows, self.uploads)
        for key in keys:
            self.res.upcoming.pop(key, None)
            if self.schedule != "klotski":
                self.cache.unhold(key)  # kept to the end of the layer, but evictable
        if self.schedule == "klotski":
            self.cache.release_all(keys)  # early release: room for the next transfers now
        self.res.pump()
        return [] if self.schedule == "klotski" else keys

    def _next_layer_prefetch(self, layer) -> list:
        """While this layer's experts compute, the link moves what the next layer needs first:
        its attention, then its gate and predicted hot experts (this layer's routing is known
        now, so the prediction is as good as it would be later). The paper starts gate + hot
        during the next attention; starting them here keeps the link busy through the
        expert phase instead of idling once the attention weights have landed."""
        nxt = layer + 1
        if nxt == self.spec.shape.num_layers:
            return [("head",), ("attn", 0)]  # then the next step's layer 0; its routing is unknown yet
        return [("attn", nxt), ("gate", nxt)] + [("expert", nxt, e) for e in self._predict(nxt)]

    def _order(self, layer, chosen, hot):
        """Experts in compute order. klotski: hot first, then those already there (or computed
        where they live), then those in flight in the order they were submitted (the channels
        are FIFO: that is the order they land in), then the rest. One readiness query per
        expert and one pass over the pending list: a Qwen3 layer has ~126 of them."""
        if self.schedule != "klotski":
            return chosen
        first = [e for e in hot if e in chosen]
        rest = [e for e in chosen if e not in first]
        now = [e for e in rest if e in self.host_experts or self.cache.ready(("expert", layer, e))]
        submitted = {key: i for i, key in enumerate(self.cache.pending)}
        later = sorted((e for e in rest if e not in now),
                       key=lambda e: submitted.get(("expert", layer, e), len(submitted)))
        return first + now + later

    # ---- adaptive gating -------------------------------------------------------------------
    def set_gating(self, thresholds: list[float] | None, *, record: bool = False) -> AdaptiveGating | None:
        """--adaptive-gating (execute/gating.py): skip by these per-MoE-layer thresholds, or
        `record` the exact routing's shares and costs (the calibration), or neither: exact
        top-k. Returns the gating now in place (its counters)."""
        self.gating = AdaptiveGating(None if record else thresholds) if record or thresholds is not None else None
        return self.gating

    # ---- residency -----------------------------------------------------------------------
    def make_room(self, nbytes: int, what) -> None:
        """Evict transient groups until `nbytes` fit (Residency.make_room)."""
        self.res.make_room(nbytes, what)

    @property
    def experts_loaded(self) -> int:
        """Expert transfers started so far."""
        return self.res.experts_loaded

    # ---- bookkeeping --------------------------------------------------------------------
    def _layer_keys(self, layer: int) -> list:
        return [("attn", layer), ("gate", layer)] + self._expert_keys(layer)

    def _expert_keys(self, layer: int) -> list:
        return [("expert", layer, e) for e in range(self.spec.shape.experts_in(layer))]

    def _predict(self, layer: int) -> list[int]:
        """Hot experts of a layer. Predictors count MoE layers only: a dense layer
        (DeepSeek's first layers, Qwen's `mlp_only_layers`) has no experts and no routing to learn from."""
        if not self.spec.shape.experts_in(layer) or not self.K:
            return []
        return self.predictor.predict(self.spec.shape.moe_index(layer), self.K)

    def _activation_bytes(self, kvs, inputs) -> int:
        """This step's activation reserve, by the planner's own formula (workingset.py)."""
        # the shared segments' keys are scored too: they count in each batch's context
        step = Step.of_batches((i.ids.shape[0], i.ids.shape[1],
                                kv.filled + i.ids.shape[1] + sum(p.length for p in layout))
                               for kv, i, layout in zip(kvs, inputs, self.layouts))
        # as the plan reserved it when every batch attends beside its host cache
        return activation_bytes(self.spec, self.cache.dtype.itemsize, step, host_attention=all(self.at_host))

    # ---- measuring ------------------------------------------------------------------------
    @contextmanager
    def instrumented(self, *, hooks=None, on_layer=None, predictor=None):
        """For measuring the pipeline (klotski/measure/): the steps run inside compute with
        `hooks` in place of the family's (stubs, a forced router), call `on_layer(layer, hidden
        states per batch)` after each layer and ask `predictor`; each left as it is when not
        given, and all put back on exit."""
        saved = self.M, self.on_layer, self.predictor, self.next_gate, self.pregate
        self.M, self.on_layer = hooks or self.M, on_layer or self.on_layer
        if predictor is not None:  # (a pre-gate's maps are the run's predictor's only)
            self.predictor, self.next_gate, self.pregate = predictor, hasattr(predictor, "speculate"), None
        try:
            yield self
        finally:
            self.M, self.on_layer, self.predictor, self.next_gate, self.pregate = saved
