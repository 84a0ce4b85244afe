"""The target's ragged pass compiled with ``torch.compile``, over a fixed set of row buckets.

The eager pass (``specdec.ragged``) spends about as long dispatching ~40 small ops a layer (norms,
rotary embeddings, activations, residual adds: each a Python call and a kernel launch) as it spends
in the layer's four weight products. Inductor fuses the small ops into a few generated loops per
layer and runs the whole stack from one call, whose wrapper code is C++ too (inductor's
``cpp_wrapper``): no Python runs between the graph's kernels and ops.

What stays outside the generated code, as opaque custom ops the graph calls, is what must keep its
bits and its state:

- **the weight products**: the same row-invariant kernels the eager pass calls
  (``specdec.packed_linear``), so no weight is copied or re-packed, and the FX graph holds no weights:
  the compiled artifact depends only on the model's shapes, and inductor's on-disk cache serves a
  restart (compiling every bucket cold takes minutes on two cores; from the cache, seconds). specdec's
  own bf16 kernel is a C++ op naming its weight by slot (``specdec_kernels::row_product``); oneDNN's
  are reached through a Python op (``specdec::packed_linear``);
- **attention with the cache update**: each session appends to its own growable cache and attends
  batch-invariantly, chains and trees alike, whatever the sessions' lengths. Where the attention
  kernel is built this is its C++ op (``specdec_attention::layer_attention``), which reads the
  caches, rows and masks a pass hands it once (``CompiledPass._claim``); else a Python op over
  ``specdec.ragged.attend_rows`` (``specdec::ragged_attention``).

A pass calls about 150 of these ops; through the dispatcher straight to C++, each skips the several
microseconds a Python op spends decoding its arguments, about a tenth of a one-token pass on the
2-core development CPU.

Shapes are static per graph: a pass's rows are padded to the next bucket of ``ROW_BUCKETS`` (as
vLLM's capture sizes do), the padding rows attend to nothing and are dropped, and a pass over more
rows than the largest bucket is fed in pieces (a session's rows split only between chain rows, a
token tree stays whole). The smallest bucket is two rows: oneDNN runs a lone row with a kernel of its
own, and two rows keep every row's bits at every count (``specdec.packed_linear.PairedPackedLinear``).

Batch invariance holds as in the eager pass: every generated loop works row by row, the products are
row-invariant and the attention is the same code, so a position gets the same bits alone, in a chain,
in a tree or beside other sessions, in any bucket (``tests/test_compiled.py``). The compiled pass's
bits are not the eager pass's (inductor fuses the layers' small ops, so their rounding differs), which
is why an engine runs every pass of a session through one of them (``TargetEngine``).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specdec.attention_kernel import attention_kernel
from specdec.kvcache import GrowableCache
from specdec.packed_linear import ProjectionSlice, RowProduct
from specdec.ragged import (
    RaggedItem,
    RaggedLayout,
    attend_rows,
    finish_layer,
    item_outputs,
    layer_ropes,
    layer_windows,
    project_qkv,
    ragged_unsupported,
    rotary_of,
)

log = logging.getLogger(__name__)

ROW_BUCKETS = (2, 4, 8, 16, 32, 48, 64)
"""Rows a compiled graph takes; a pass pads to the next (see the module docstring)."""

# Custom ops take tensors and numbers only, so a graph names its runner by its index here. Runners
# are created once per served model and live as long as the process.
_RUNNERS: list[CompiledPass] = []

# The ops are registered through a plain ``Library`` rather than ``torch.library.custom_op``: a pass
# calls them about 150 times, and custom_op's Python wrapper costs ~13 us a call more (2 ms a pass).
_LIBRARY = torch.library.Library("specdec", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, int runner, int index) -> Tensor")
_LIBRARY.define("ragged_attention(Tensor q, Tensor k, Tensor v, int runner, int layer) -> Tensor")


def _packed_linear(x: torch.Tensor, runner: int, index: int) -> torch.Tensor:
    """Product ``index`` of runner ``runner`` over rows ``x [N, in]``; returns ``[N, out]``."""
    return _RUNNERS[runner].kernels[index](x)


def _ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runner: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention of the pass runner ``runner`` is running (``CompiledPass.attend``)."""
    return _RUNNERS[runner].attend(q, k, v, layer)


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
_LIBRARY.impl("ragged_attention", _ragged_attention, "CPU")


@torch.library.register_fake("specdec::packed_linear", lib=_LIBRARY)
def _(x: torch.Tensor, runner: int, index: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _RUNNERS[runner].products[index].out_features)


@torch.library.register_fake("specdec::ragged_attention", lib=_LIBRARY)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runner: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[2], q.shape[1] * q.shape[3])


def keep_artifacts_in(cache_dir: Path) -> None:
    """Has inductor keep its compiled artifacts under ``cache_dir / "inductor"`` (unless the environment
    names a place), so that a restart on this machine finds them. Inductor reads the place from the
    environment when it first compiles, so this runs before."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))


def build_compiled(
    model: PreTrainedModel, cache_dir: Path, buckets: tuple[int, ...] = ROW_BUCKETS, cpp_wrapper: bool = True
) -> CompiledPass:
    """``model``'s compiled pass over row ``buckets``, built now, its artifacts kept under
    ``cache_dir`` (from there in seconds when an earlier build left them; minutes cold)."""
    keep_artifacts_in(cache_dir)
    compiled = CompiledPass(model, buckets, cpp_wrapper=cpp_wrapper)
    compiled.compile()
    return compiled


def compile_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run the compiled pass, or None when it can: it must run the ragged pass, on
    a CPU, with its projections packed and fused (``specdec.packed_linear.pack_linears``)."""
    reason = ragged_unsupported(model.config)
    if reason is not None:
        return reason
    if model.device.type != "cpu":
        return f"the compiled pass runs on CPU (packed kernels); this model is on {model.device}"
    layer = model.get_decoder().layers[0]
    if _fused(layer.self_attn, "qkv_proj", "q_proj") is None or _fused(layer.mlp, "gate_up_proj", "gate_proj") is None:
        return "the compiled pass needs packed, fused projections (load the model with pack=True)"
    return None


def _fused(module: nn.Module, own: str, first: str) -> nn.Module | None:
    """The one product computing a group of sibling projections: the family's own fused layer (``own``,
    Phi-3's), or the packed product behind the first projection's slice."""
    if hasattr(module, own):
        return getattr(module, own)
    slice_ = getattr(module, first)
    return slice_.fused.product if isinstance(slice_, ProjectionSlice) else None


@dataclass
class _Pass:
    """What the attention op of the pass in progress reads: the sessions' caches and layout."""

    caches: list
    layout: RaggedLayout


class CompiledPass:
    """``ragged_forward`` for one model through graphs compiled per row bucket.

    ``compile`` builds every bucket's graph (minutes cold, seconds from inductor's cache); until it
    has, ``ready`` is False. A model runs one pass at a time (its service's worker thread), and the
    compile may run on another thread meanwhile: its passes use caches of their own.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        buckets: tuple[int, ...] = ROW_BUCKETS,
        native_ops: bool = True,
        cpp_wrapper: bool = True,
    ) -> None:
        """``native_ops``: call the kernels' C++ ops where they are built (False: the Python ops
        throughout, which compute the same bits more slowly; for comparison). ``cpp_wrapper``: the
        code that calls a graph's kernels and ops in order is generated as C++ (False: as Python,
        which calls the same kernels with the same arguments; for comparison)."""
        reason = compile_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.buckets = tuple(sorted(buckets))
        decoder = model.get_decoder()
        self._layers = list(decoder.layers[: model.config.num_hidden_layers])
        self._windows = layer_windows(model.config)
        # Per layer: qkv, o, gate_up, down, at 4 i .. 4 i + 3.
        self.products: list[nn.Module] = []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = (_fused(attn, "qkv_proj", "q_proj"), attn.o_proj, _fused(mlp, "gate_up_proj", "gate_proj"))
            self.products.extend([*fused, mlp.down_proj])
        # The products' forward methods, called without nn.Module's per-call hook machinery; and the
        # weight slots of those on specdec's own kernel, which the graph calls as a C++ op instead.
        self.kernels: list[Callable[[torch.Tensor], torch.Tensor]] = [p.forward for p in self.products]
        self._slots = [p.slot() if native_ops and isinstance(p, RowProduct) else None for p in self.products]
        # Attention through the kernel's own op where it is built (every session cache a GrowableCache,
        # as the engines' are): what each layer needs is handed over once a pass (``_claim``).
        self._native_attention = native_ops and attention_kernel() is not None
        attn = self._layers[0].self_attn  # the key heads and their width, as ``project_qkv`` reads them
        self._kv_like = torch.zeros(1, attn.config.num_key_value_heads, 1, attn.head_dim, dtype=model.dtype)
        self._scales = [float(layer.self_attn.scaling) for layer in self._layers]
        # Each layer's rotary table among the distinct ones (Gemma 3: one per layer type, else one).
        types = getattr(decoder.rotary_emb, "layer_types", None) and list(model.config.layer_types)
        types = types[: len(self._layers)] if types else [None] * len(self._layers)
        kinds = sorted(set(types), key=str)
        self._table_of = tuple(kinds.index(t) for t in types)
        self._context: _Pass | None = None
        self._ready = threading.Event()
        self.compile_s: float | None = None
        self._index = len(_RUNNERS)
        _RUNNERS.append(self)
        # A graph calls its generated loops and the ~150 product and attention ops one after another; a
        # Python wrapper spends interpreter time on each call, a C++ one none (``make pass-curve`` compares).
        options = {"cpp_wrapper": cpp_wrapper}
        self._graph = torch.compile(self._stack, dynamic=False, fullgraph=True, options=options)

    @property
    def ready(self) -> bool:
        """Whether every bucket's graph is built."""
        return self._ready.is_set()

    def compile(self) -> None:
        """Builds every bucket's graph by running it once over a scratch cache; then ``ready``."""
        started = time.perf_counter()
        # Every runner's graphs hang off the one code object of ``_stack``, a graph per runner and bucket;
        # dynamo's default limit of 8 is for code that recompiles unexpectedly.
        limit = len(_RUNNERS) * len(ROW_BUCKETS + self.buckets)
        with torch._dynamo.config.patch(recompile_limit=limit):
            for rows in self.buckets:
                self.forward([RaggedItem(GrowableCache(), [0] * rows, 1)], compiling=True)
                log.info("compiled the %d-row pass (%.0f s so far)", rows, time.perf_counter() - started)
        self.compile_s = time.perf_counter() - started
        self._ready.set()

    def _product(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        slot = self._slots[index]
        if slot is not None:  # a C++ op: no Python between the graph and the kernel
            width = self.products[index].out_features
            return lambda x: torch.ops.specdec_kernels.row_product(x, slot, width)
        return lambda x: torch.ops.specdec.packed_linear(x, self._index, index)

    def _stack(self, ids: torch.Tensor, tables: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph: token ids ``[P]`` and the rotary tables (cos, sin per distinct table, ``[1, P, rd]``)
        in; the final-norm rows ``[P, D]`` and every layer's output ``[P, D]`` out."""
        decoder = self.model.get_decoder()
        x = decoder.embed_tokens(ids)  # [P, D]
        outs = []
        for i, layer in enumerate(self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            q, k, v = (t.transpose(0, 1)[None] for t in project_qkv(attn, h, self._product(4 * i)))  # [1, H, P, hd]
            table = self._table_of[i]
            q, k = rotary_of(attn)(q, k, tables[2 * table], tables[2 * table + 1])
            attended = self._product(4 * i + 1)(self._attend_op(q, k, v, i))
            gate_up = self._product(4 * i + 2)
            down = self._product(4 * i + 3)

            act = getattr(mlp, "act_fn", None) or mlp.activation_fn  # Phi-3 names it activation_fn

            def gated(h: torch.Tensor, gate_up=gate_up, down=down, act=act) -> torch.Tensor:
                gate, up = gate_up(h).chunk(2, dim=-1)
                return down(act(gate) * up)

            x = finish_layer(layer, x, attended, gated)
            outs.append(x)
        return [decoder.norm(x), *outs]

    def _attend_op(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        if self._native_attention:  # the kernel's own op, reading what ``_claim`` handed it
            return torch.ops.specdec_attention.layer_attention(q, k, v, self._index, layer)
        return torch.ops.specdec.ragged_attention(q, k, v, self._index, layer)

    def _hold(self, caches: list, layout: RaggedLayout) -> Callable[[], None]:
        """Keeps the pass's caches and layout for the Python attention op (``attend``); returns what
        forgets them after the pass."""
        self._context = _Pass(caches, layout)
        return lambda: setattr(self, "_context", None)

    def _claim(self, caches: list, layout: RaggedLayout) -> Callable[[], None]:
        """Claims every layer's room for the pass's rows in each session's cache and hands the buffers,
        rows and masks to the attention kernel's op (``set_pass``), once for the pass rather than in
        each layer's op; returns what forgets them after the pass."""
        kernel = attention_kernel()
        assert kernel is not None
        lengths = [cache.get_seq_length() + n for cache, n in zip(caches, layout.sizes)]
        keys: list[list[torch.Tensor]] = []
        values: list[list[torch.Tensor]] = []
        for i in range(len(self._layers)):
            claims = [cache.layer(i).claim(self._kv_like, n) for cache, n in zip(caches, layout.sizes)]
            keys.append([claim[0] for claim in claims])
            values.append([claim[1] for claim in claims])
        by_window = {
            w: [None if m is None else m.contiguous() for m in layout.masks_for(w)] for w in set(self._windows)
        }
        masks = [by_window[window] for window in self._windows]
        kernel.set_pass(self._index, keys, values, layout.bounds, lengths, masks, self._scales)
        return lambda: kernel.clear_pass(self._index)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """The attention op's body: the pass's real rows attend (``attend_rows``), the padding gets zeros.
        ``q [1, Hq, P, hd]``, ``k``, ``v`` ``[1, Hkv, P, hd]``; returns ``[P, Hq hd]``."""
        ctx = self._context
        assert ctx is not None, "the attention op runs only inside CompiledPass.forward"
        return attend_rows(self._layers[layer].self_attn, q, k, v, ctx.caches, ctx.layout, layer, self._windows[layer])

    @torch.inference_mode()
    def forward(
        self, items: list[RaggedItem], compiling: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What ``specdec.ragged.ragged_forward`` returns for ``items``, computed by the compiled graphs
        (``compiling``: while ``compile`` builds them)."""
        if not (compiling or self.ready):
            raise RuntimeError("the compiled pass is not built yet (CompiledPass.compile)")
        wanted = sorted({j for item in items for j in item.side_layers})
        hidden: list[list[torch.Tensor]] = [[] for _ in items]
        sides: list[dict[int, list[torch.Tensor]]] = [{j: [] for j in wanted} for _ in items]
        for group in pieces(items, self.buckets[-1]):
            outs = self._run_group(items, group)
            offset = 0
            for index, lo, hi in group:
                hidden[index].append(outs[0][offset : offset + hi - lo])
                for j in wanted:
                    sides[index][j].append(outs[1 + j][offset : offset + hi - lo])
                offset += hi - lo
        bounds = [0, *itertools.accumulate(len(item.tokens) for item in items)]
        rows = torch.cat([torch.cat(h) for h in hidden])  # [N, D]
        side_rows = {j: torch.cat([torch.cat(s[j]) for s in sides]) for j in wanted}
        return item_outputs(self.model, items, bounds, rows, side_rows)

    def _run_group(self, items: list[RaggedItem], group: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One graph call over pieces ``(item, lo, hi)``: rows ``lo .. hi`` of each item's tokens."""
        device = self.model.device
        caches = [items[i].cache for i, _, _ in group]
        trees = [items[i].parents if hi == len(items[i].tokens) else None for i, _, hi in group]
        layout = RaggedLayout.of(
            [hi - lo for _, lo, hi in group],
            [cache.get_seq_length() for cache in caches],
            device=device,
            windows=self._windows,
            trees=trees,
        )
        rows = layout.bounds[-1]
        padded = next(b for b in self.buckets if b >= rows)
        ids = torch.tensor(
            [t for i, lo, hi in group for t in items[i].tokens[lo:hi]] + [0] * (padded - rows),
            dtype=torch.long,
            device=device,
        )  # [P]
        positions = F.pad(layout.positions[None], (0, padded - rows), mode="replicate")  # [1, P]
        decoder = self.model.get_decoder()
        embedded = decoder.embed_tokens.weight[:1]  # the rotary tables take the activations' dtype from it
        per_layer = layer_ropes(decoder.rotary_emb, self.model.config, embedded, positions)
        tables: list[torch.Tensor] = []
        for table in range(max(self._table_of) + 1):
            tables.extend(per_layer[self._table_of.index(table)])
        forget = (self._claim if self._native_attention else self._hold)(caches, layout)
        try:
            if not self.ready:  # while compiling, dynamo checks every guard and builds what is missing
                return self._graph(ids, tables)
            # Built: the graphs differ only in their bucket's row count, so dynamo needs to check only
            # the guards that tell them apart, not all of the model's (about 0.45 ms a pass).
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._graph(ids, tables)
        finally:
            forget()


def pieces(items: list[RaggedItem], limit: int) -> list[list[tuple[int, int, int]]]:
    """The items' rows in groups of at most ``limit``: each group a list of ``(item, lo, hi)``, an item's
    rows ``lo .. hi``, in item order, each item's pieces in row order. A token tree's rows stay in one
    piece (the rows before it may be split anywhere)."""
    groups: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = limit
    for index, item in enumerate(items):
        n = len(item.tokens)
        whole_from = n - len(item.parents) if item.parents else n  # rows from here on go in one piece
        if n - whole_from > limit:
            raise ValueError(f"a token tree of {n - whole_from} nodes exceeds the largest compiled pass ({limit} rows)")
        lo = 0
        while lo < n:
            cut = lo + room if lo + room < n else n
            if whole_from < cut < n:
                cut = whole_from
            if cut <= lo:  # nothing fits in what is left of this group
                groups.append(current)
                current, room = [], limit
                continue
            current.append((index, lo, cut))
            room -= cut - lo
            lo = cut
            if room == 0:
                groups.append(current)
                current, room = [], limit
    if current:
        groups.append(current)
    return groups
