"""Frozen configuration of each service, built once at the edge (CLI flags and env) and passed down."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

MAX_K = 32
# Most nodes of one round's token tree (specdec.trees): a verify row each.
MAX_TREE_NODES = 32
# What ``--dtype`` takes: "auto" (float32 on a CPU, the checkpoint's dtype on a GPU) or a torch dtype.
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")

# ModelInfo.kind of a draft that reads the target's hidden states (HiddenStates in the protocol).
FEATURE_KIND = "feature"
# ngram: prompt lookup; model: a causal LM or a distilled token draft; feature: a distilled EAGLE-style draft.
DRAFT_KINDS = ("ngram", "model", FEATURE_KIND)
DEFAULT_DRAFT_KIND = FEATURE_KIND
# Drafts shipped for the default target, by kind: folders of the ``drafts`` package's data. An n-gram
# draft has none; it speaks the default target's tokenizer.
SHIPPED_DRAFTS = {"model": "smollm2-135m-token", FEATURE_KIND: "smollm2-135m-feature"}


def default_cache_dir() -> Path:
    """Where converted models, inductor artifacts and drafts' references live unless told (read when
    called, never at import)."""
    return Path.home() / ".cache" / "specdec"


def shipped_draft(name: str) -> Path:
    """The folder of a draft shipped with specdec, such as ``smollm2-135m-feature``."""
    return Path(str(files("drafts") / name))


def default_draft_model(kind: str, target_model: str = "default") -> str:
    """The draft a kind uses when none is named: the one shipped for the default target, and for
    n-gram lookup the target itself, whose tokenizer its proposals must speak.

    Raises ValueError for a model or feature draft of another target: only the default has one shipped.
    """
    if kind not in SHIPPED_DRAFTS:
        return target_model
    if target_model != "default":
        raise ValueError(
            f"no {kind} draft ships for target {target_model!r}: name one with --draft-model "
            "(make one with `specdec distill`), or draft with --draft-kind ngram"
        )
    return str(shipped_draft(SHIPPED_DRAFTS[kind]))


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a gRPC server listens."""

    host: str = "127.0.0.1"
    # 0 picks a free port; the bound port is reported at start-up.
    port: int = 0
    # Largest request or reply in bytes; bigger messages get RESOURCE_EXHAUSTED.
    max_message_bytes: int = 8 * 1024 * 1024
    # Seconds in-flight calls get to finish after SIGTERM.
    grace_s: float = 5.0
    # OTLP/gRPC endpoint for traces (for example Jaeger's host:4317); None exports nothing.
    otlp_endpoint: str | None = None
    # Port of the Prometheus metrics endpoint (plain HTTP on ``host``); 0 picks a free one, None serves none.
    metrics_port: int | None = None
    # PEM certificate chain and private key: set both to serve TLS; None serves plaintext.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # PEM CA bundle that client certificates must chain to; set, the server demands one (mutual TLS).
    tls_client_ca: Path | None = None
    # A plaintext port serving only gRPC health, for probes that cannot speak TLS (kubelet's); None: none.
    health_port: int | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its private key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("a client CA (mutual TLS) needs the server's own certificate and key")


@dataclass(frozen=True)
class TlsClientConfig:
    """How a client opens TLS channels: which CAs it trusts and, for mutual TLS, its own certificate."""

    # PEM CA bundle the server's certificate must chain to; None trusts gRPC's default roots.
    ca: Path | None = None
    # PEM certificate chain and private key presented to servers that demand one (mutual TLS).
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its private key, and the key its certificate")


@dataclass(frozen=True)
class ModelConfig:
    """Which model a service loads and how it computes."""

    # "default" (the embedded SmolLM2-135M-Instruct), a Hugging Face folder, or a .gguf file.
    model: str = "default"
    # Where converted models are cached.
    cache_dir: Path = field(default_factory=default_cache_dir)
    # torch intra-op threads; draft and target on one machine must share the cores deliberately.
    threads: int = 1
    # Session caches held at once; the least recently used is evicted past this.
    max_sessions: int = 64
    # MiB of KV buffers all session caches may take (0: no budget); idle caches go first past it.
    kv_budget_mb: int = 0
    # Seconds after which an unused session cache is dropped (0: never).
    cache_idle_s: float = 3600.0
    # A new session whose first this-many or more tokens another cache holds state for copies that
    # state instead of computing it (``specdec.kvcache.CacheTable``; 0: off).
    prefix_reuse: int = 16
    # Prepack linear weights for oneDNN: a verify pass over k+1 tokens then costs about one step.
    pack: bool = True
    # Whether the packed bf16 products read the weights with the non-temporal hint, so that a pass's
    # weight stream does not evict what is used again; None: when they outgrow the host's last-level
    # cache (``specdec.packed_linear.streams_weights``).
    stream_weights: bool | None = None
    # The torch device the model computes on: "cpu", or "cuda" / "cuda:N".
    device: str = "cpu"
    # The weights' and activations' dtype (``MODEL_DTYPES``): "auto" takes bfloat16 on a CPU that computes
    # it natively, float32 on other CPUs, and the checkpoint's own dtype on a GPU (``resolve_dtype``).
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(MODEL_DTYPES)}")

    def cache_limits(self) -> dict[str, float]:
        """The session cache bounds beyond ``max_sessions`` and the prefix reuse, as engine keyword
        arguments."""
        return {"budget_bytes": self.kv_budget_mb * 2**20, "idle_s": self.cache_idle_s, "reuse_min": self.prefix_reuse}


@dataclass(frozen=True)
class TensorParallelConfig:
    """How one target replica is sharded over processes (``torch.distributed``, torchrun's variables).

    Rank 0 serves gRPC; the other ranks hold their shards and follow rank 0's passes.
    """

    # Processes the target's attention heads and MLP are split over; 1 runs unsharded.
    world_size: int = 1
    # This process's place in the group.
    rank: int = 0
    # Rendezvous of the group (torchrun's MASTER_ADDR / MASTER_PORT); port 0: the launcher picks one.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # True when torchrun (or another launcher) started every rank; else rank 0 starts the others.
    launched: bool = False
    # The process that started this follower (rank 0 when it launched the group); None: the parent.
    launcher_pid: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor parallel: rank {self.rank} is outside a group of {self.world_size}")


COMPILE_MODES = ("off", "background", "wait")
"""How the target service compiles its pass (``specdec.compiled``): not at all; on a thread of its own
while it serves eager passes, switching when the graphs are built; or before it reports ready."""


@dataclass(frozen=True)
class TargetConfig:
    """The target service."""

    server: ServerConfig = ServerConfig()
    model: ModelConfig = ModelConfig()
    # Most token rows one batched verify pass feeds; later arrivals wait for the next pass.
    max_batch_rows: int = 256
    # A prompt that arrives while passes run is fed in its session's first verify pass, beside the
    # others' rows, rather than in a pass of its own (see TargetServicer.Prefill).
    fold_prefills: bool = True
    # A longer prompt is fed this many tokens a pass, beside the running sessions' rounds, so none of
    # them waits for the whole prompt (0: one pass of its own). With no session running a pass takes
    # up to max_batch_rows - 1 of its tokens.
    prefill_chunk: int = 128
    tp: TensorParallelConfig = TensorParallelConfig()
    # One of COMPILE_MODES. A cold compile takes minutes on a small CPU, a restart's seconds (inductor's
    # cache under the cache directory); a target the compiled pass cannot run stays eager.
    compile: str = "off"

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile: must be one of {', '.join(COMPILE_MODES)}")
        if self.tp.world_size > 1 and self.model.device != "cpu":
            raise ValueError(
                "device: tensor-parallel ranks compute on CPU tensors (gloo); a sharded target takes --device cpu"
            )


@dataclass(frozen=True)
class DraftConfig:
    """The draft service."""

    server: ServerConfig = ServerConfig()
    # "ngram" (prompt lookup, no model), "model" (a small causal LM sharing the target's tokenizer, or a
    # distilled token draft) or "feature" (a distilled EAGLE-style draft reading the target's hidden states).
    kind: str = "ngram"
    # For kind "model", the draft model; for "ngram", the model whose tokenizer it speaks.
    model: ModelConfig = ModelConfig()
    # The target a distilled token draft was made for: it lends the draft its embedding.
    target_model: str = "default"
    # Longest and shortest suffix the n-gram drafter looks up.
    ngram_max: int = 3
    ngram_min: int = 1
    # A model draft samples only among its own top tokens: q stays exact and cheap to send.
    sample_top_k: int = 64
    # A feature draft's head in int8: a third cheaper per step for about 1% of acceptance.
    int8_head: bool = True
    # A feature draft first tries prompt lookup (suffixes of lookup_min..4 tokens) and keeps it when it
    # yields all k tokens; 0 turns that off.
    lookup_min: int = 2
    # Nodes each level of a draft tree expands (EAGLE-2's beam); 0: the kind's default, 4 for a
    # feature draft, 1 (one path) for a model draft.
    tree_beam: int = 0
    # Torch threads from the draft's size at start-up (``draft_service.server.auto_draft_threads``)
    # rather than ``model.threads``: one for a small draft, more for a model draft.
    auto_threads: bool = False
    # The cores this process may run on (``os.sched_getaffinity``), for ``auto_threads``.
    cores: int = 1
    # Whether the draft's idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, as ``specdec up`` runs
    # it), so that threads it idles while the target verifies take no core from the target.
    passive_wait: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tree_beam <= MAX_TREE_NODES:
            raise ValueError(f"tree_beam: must be 0 (the kind's default) or a node count up to {MAX_TREE_NODES}")


@dataclass(frozen=True)
class AdmissionLimits:
    """How many requests may run at once, wait behind them, and be held by one client, and how many
    live sessions one client may have (0: no limit)."""

    max_active: int = 32
    max_queued: int = 128
    max_per_client: int = 0
    max_sessions_per_client: int = 0


@dataclass(frozen=True)
class DnsDiscovery:
    """Replicas behind one DNS name (a headless Service): every A and AAAA record, looked up again
    every discovery interval (``dns:///host:port``)."""

    host: str
    port: int

    @property
    def tls_name(self) -> str:
        """The name a replica's TLS certificate is checked against: its addresses are bare IPs."""
        return self.host


@dataclass(frozen=True)
class KubernetesDiscovery:
    """Replicas of one Kubernetes Service: the ready endpoints of its EndpointSlices, watched through
    the Kubernetes API (``k8s:///namespace/service:port``)."""

    namespace: str
    service: str
    # The pods' port: a number, or the name of a Service port (the slices then carry its target port).
    port: int | str

    @property
    def tls_name(self) -> str:
        """The name a replica's TLS certificate is checked against (the Service's): its addresses are bare IPs."""
        return f"{self.service}.{self.namespace}.svc"


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator."""

    server: ServerConfig = ServerConfig()
    # Draft and target replicas as fixed host:port lists; a new session goes to the least busy one.
    draft_addresses: tuple[str, ...] = ()
    target_addresses: tuple[str, ...] = ()
    # Or found while running (coordinator.discovery), instead of a list: replicas join and leave.
    draft_discovery: DnsDiscovery | KubernetesDiscovery | None = None
    target_discovery: DnsDiscovery | KubernetesDiscovery | None = None
    # Seconds between DNS lookups; also the longest wait before a failed Kubernetes watch is retried.
    discovery_interval_s: float = 10.0
    # Model whose tokenizer renders prompts and decodes output; must match the target's.
    tokenizer: ModelConfig = ModelConfig()
    # Jinja chat template that replaces the tokenizer's own (``specdec.chat_templates``); None: its own.
    chat_template: str | None = None
    # Session records; "memory://" keeps them in process (tests only), "rediss://" speaks TLS.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis AUTH password, kept out of the URL (and so out of process listings); None: none or in the URL.
    redis_password: str | None = field(default=None, repr=False)
    # PEM CA bundle a rediss:// server's certificate chains to; None: the system's.
    redis_ca: Path | None = None
    # Idle sessions expire after this many seconds.
    session_ttl_s: int = 3600
    # Draft length when a request does not choose one; None picks k each round (coordinator.adaptive).
    default_k: int | None = None
    # Largest k the adaptive choice considers.
    max_auto_k: int = 8
    # Deadline of each call to a target service.
    rpc_timeout_s: float = 30.0
    # Deadline of each call to a draft service: short, since a late draft only costs its round the
    # speculation, while waiting for it holds the round up.
    draft_timeout_s: float = 5.0
    # Seconds to wait at start-up for the listed replicas to report ready, or for discovery to find a
    # ready target.
    startup_timeout_s: float = 300.0
    # SHA-256 hex digests of the API keys a client may send (``authorization: Bearer <key>``); empty
    # leaves the coordinator open. Only hashes are held, so a memory dump does not reveal the keys.
    api_key_hashes: tuple[str, ...] = ()
    # TLS of the coordinator's channels to draft and target replicas; None speaks plaintext.
    backend_tls: TlsClientConfig | None = None
    # Requests running at once, waiting behind them, and held by one client.
    admission: AdmissionLimits = AdmissionLimits()
    # The draft shares the target's cores (one machine without accelerators): under load a draft
    # call then slows the target's pass too, and k is chosen accordingly.
    draft_colocated: bool = False
    # When the draft service is not worth its cost (a poor draft, or a shared pass on shared cores),
    # the coordinator proposes by prompt lookup itself, from context suffixes of this many tokens up
    # (greedy requests; 0: off). A lookup costs no draft compute, only the verify rows it adds.
    free_lookup_min: int = 3
    # With k chosen each round, the draft also stops early where its confidence no longer pays for
    # the tokens it adds (coordinator.adaptive.CostModel.min_confidence; draft_service.picking).
    confidence_cutoff: bool = True
    # Tokens a feature draft drafts ahead while the target verifies a lone session's round, on the
    # guess that the whole proposal passes (0: off; see ProposeRequest.ahead). It pays where the
    # draft has cores of its own; on shared cores it takes one from the target's pass.
    draft_ahead: int = 0
    # Most nodes of a round's token tree (0: chains only). With k chosen each round, the coordinator
    # picks each round's tree size and shape, or a chain, from measured costs and acceptance
    # (coordinator.tree_choice); a stack whose draft or target handles no trees runs chains.
    tree_nodes: int = 15
    # Least seconds between two checkpoints of a running turn (its first and last go at once); a
    # resume after a coordinator's loss replays at most this much (coordinator.checkpoints).
    checkpoint_interval_s: float = 0.25
    # Port of the OpenAI-compatible HTTP API (coordinator.openai_api) on ``server.host``, with the
    # gRPC port's TLS and API keys; 0 picks a free port, None serves none.
    http_port: int | None = None
    # Other names the HTTP API accepts for the served model, listed by /v1/models after its own id.
    served_model_names: tuple[str, ...] = ()
    # Browser origins the HTTP API answers CORS for ("*": any); empty sends no CORS headers.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.draft_addresses and self.draft_discovery is not None:
            raise ValueError("draft replicas come from a list or from discovery, not both")
        if self.target_addresses and self.target_discovery is not None:
            raise ValueError("target replicas come from a list or from discovery, not both")
        if not self.discovery_interval_s > 0:
            raise ValueError("the discovery interval must be positive")
        if self.free_lookup_min < 0:
            raise ValueError("free_lookup_min: must be 0 (off) or a suffix length of at least 1")
        if not 0 <= self.draft_ahead <= MAX_K:
            raise ValueError(f"draft_ahead: must be 0 (off) or a number of tokens up to {MAX_K}")
        if not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"tree_nodes: must be 0 (chains only) or a node count up to {MAX_TREE_NODES}")
        if not 0 <= self.checkpoint_interval_s < 3600:
            raise ValueError("checkpoint_interval_s: must be 0 (every round) or a number of seconds below an hour")
