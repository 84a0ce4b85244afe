"""The settings of one distillation run, parsed once at the edge and passed down frozen."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

DEVICES = ("cpu", "cuda")
"""``--device`` values."""
DTYPES = ("auto", "float32", "bfloat16")
"""``--dtype`` values; float16 is left out because it would need loss scaling to train."""


@dataclass(frozen=True)
class DistillConfig:
    """Everything ``specdec distill`` does is decided by these fields (and the machine's speed)."""

    target: str
    """Target model: ``default``, a Hugging Face folder or a ``.gguf`` file."""
    out: Path
    """Folder the draft (weights + card) is written to."""
    work: Path
    """Folder for data shards and training checkpoints (``--resume`` continues from it)."""
    cache_dir: Path
    """Where converted models are cached."""
    command: str
    """The command line as given, recorded in the card."""
    kind: str = "token"
    minutes: float = 15.0
    """Compute budget for collection + training (evaluation comes on top)."""
    tokens: int = 80_000
    """Generated target tokens to collect for training (the time budget may stop sooner)."""
    seed: int = 0
    resume: bool = False
    collect_only: bool = False
    """Stop once the data is collected (a later ``--resume`` trains on it)."""
    threads: int = 2
    device: str = "cpu"
    """Where the target and the draft's training compute: ``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """The target's dtype and the draft's training autocast (``DTYPES``); ``auto``: the target in
    bfloat16 where the device computes it natively, else float32, and bf16 training on a GPU only
    (``placement.resolve_placement``)."""
    progress: bool = False
    """Draw progress bars (the CLI turns them on when stderr is a terminal); else log a line now and then."""
    # data
    prompts_file: Path | None = None
    """The user's prompts (``user_prompts``: OpenAI ``messages`` JSONL or ShareGPT JSON) instead of the
    built-in set; ``prompts`` and ``held_out`` then do not apply."""
    data: Path | None = None
    """A ``specdec distill-data`` folder: train on up to ``tokens`` of its answers and evaluate on its
    held-out requests; nothing is collected, and the prompt options do not apply."""
    held_out_share: float = 0.05
    """With ``prompts_file``: share of each category's conversations held out."""
    held_out_cap: int = 50
    """With ``prompts_file``: at most this many conversations held out per category (references are
    collected for every held-out prompt before training); with ``data``: at most this many of each
    category's held-out requests evaluated."""
    prompts: int = 20_000
    """Prompts built (in a seeded order; collection uses as many as the budgets allow)."""
    held_out: int = 48
    """Prompts held out for evaluation (never trained on)."""
    prompt_offset: int = 0
    """Training prompts (in seeded order) to skip: those a warm start's source was already trained on."""
    batch_size: int = 48
    max_new: int = 128
    eval_max_new: int = 128
    temperatures: tuple[float, ...] = (0.0, 0.8)
    """Cycled over collection batches; 0.0 is greedy."""
    collect_share: float = 0.6
    """Share of ``minutes`` that collection may take at most."""
    # draft
    layers: int = 2
    init_from: tuple[int, ...] = (0, 1)
    head_size: int = 8192
    side_layers: tuple[int, ...] = ()
    """Feature draft: target layers whose outputs it reads besides the final-norm feature (EAGLE-3)."""
    init_draft: Path | None = None
    """Feature draft: a distilled draft of the same target to start from instead of the target's layer."""
    # training
    lr: float = 3e-3
    epochs: float = 4.0
    batch_tokens: int = 4096
    soft_weight: float = 0.5
    """Weight of distillation on the target's top-16 distribution, besides its argmax."""
    rollout_steps: int = 2
    """Feature draft: draft steps trained per position (the first plus rollout steps on its own features)."""
    prompt_weight: float = 0.0
    """Loss weight of the target's argmax teacher-forced over prompt tokens (0: generated tokens only)."""
    max_len: int = 512
    extra_eval: tuple[Path, ...] = field(default_factory=tuple)
    """JSONL prompt files evaluated on (never trained on), e.g. the benchmark's prompts."""

    def recipe(self) -> dict:
        """The settings as JSON-friendly values, for the card."""
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        out["extra_eval"] = [str(p) for p in self.extra_eval]
        out["init_draft"] = None if self.init_draft is None else str(self.init_draft)
        out["prompts_file"] = None if self.prompts_file is None else str(self.prompts_file)
        out["data"] = None if self.data is None else str(self.data)
        for k in ("out", "work", "cache_dir", "resume", "command", "collect_only", "progress"):
            out.pop(k)
        return out


@dataclass(frozen=True)
class DataConfig:
    """What ``specdec distill-data`` collects and where."""

    target: str
    """``default``, a Hugging Face folder or a GGUF file."""
    data: Path
    """The data folder, created or continued (``draft_service.distill.data``)."""
    cache_dir: Path
    """Where converted models and the compiled pass's artifacts live."""
    composed: int = 40_000
    """Composed requests in a new corpus (before its held-out split)."""
    meta: int = 1_500
    """Self-instruct requests to the target in a new corpus."""
    follow_up_share: float = 0.5
    """Share of the greedy chat answers (of the first ``ANSWERS_FIRST``) that get a second user turn."""
    max_new: int = 192
    """Longest answer to a request, in tokens."""
    meta_max_new: int = 48
    """Longest request the target writes in the self-instruct stage."""
    longest_prompt: int = 1024
    """Longer rendered prompts are skipped."""
    width: int = 32
    """Sessions in one pass (on a GPU, prompts in one wave: hundreds)."""
    per_shard: int = 128
    """Answers in one shard file."""
    minutes: float = 60.0
    """No new prompt is taken after this long; running answers finish into the last shard."""
    tokens: int = 2_000_000
    """Stop once the answer stages hold this many generated tokens."""
    dtype: str = "auto"
    """The target's dtype (``auto``: as the target service serves it)."""
    compile: bool = True
    """Answer on the compiled pass (as the target service does by default), else the eager one."""
    device: str = "cpu"
    """``cpu``: the serving pass, continuously batched (``stream_collect``); ``cuda``: padded waves over
    transformers' forward (``wave_collect``)."""
    threads: int = 2
    """torch threads: 1 where other jobs share the cores."""
    seed: int = 0
    """Seeds the corpus, the held-out split and every sampled answer."""
    progress: bool = False
    """Draw progress bars (the CLI does on a terminal); else log a line now and then."""
