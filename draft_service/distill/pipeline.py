"""One distillation run: prompts → target continuations → training → held-out evaluation → card.

A run refuses, before it loads the target or builds a prompt, a target whose family it makes no draft
for (``DISTILL_FAMILIES``), and stops rather than trains when collection produced no training token.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from draft_service.distill import corpus
from draft_service.distill.collect import CollectPlan, collect, load_shards
from draft_service.distill.config import DistillConfig
from draft_service.distill.data import Paths, training_pairs
from draft_service.distill.evaluate import (
    evaluate,
    evaluate_feature,
    feature_tallies,
    ms_per_step,
    summarise,
    summarise_by_category,
    token_tallies,
)
from draft_service.distill.feature_train import feature_batcher, feature_loss, make_feature_examples
from draft_service.distill.features import extract_features
from draft_service.distill.placement import DeviceUnavailable, Placement, resolve_placement
from draft_service.distill.prompts import Prompt, build_prompts, harvest_stdlib, split_prompts
from draft_service.distill.train import TrainConfig, make_examples, token_batcher, token_loss, top_tokens, train
from draft_service.distill.user_prompts import PromptFileError, load_user_prompts
from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.feature_draft import (
    FeatureDraftArch,
    build_feature_draft,
    save_feature_draft,
    source_head_ids,
    warm_start,
)
from draft_service.token_draft import (
    CARD_FILE,
    KIND,
    TokenDraftArch,
    build_token_draft,
    save_token_draft,
    target_weights_hash,
)
from specdec.config import DraftConfig
from specdec.models import LoadedModel, load_config, load_model
from specdec.ragged import RAGGED_FAMILIES, ragged_unsupported
from specdec.vocab import resolve_model_path

log = logging.getLogger(__name__)

DISTILL_FAMILIES = RAGGED_FAMILIES
"""Target model types (``config.model_type``) ``specdec distill`` makes drafts for. A draft is built of
its target family's own decoder layers and served through the ragged pass (``specdec.ragged``), and
its training computes those layers with the same helpers, so it can be made for those families only."""


class DistillError(RuntimeError):
    """A run that cannot make a draft: an unsupported target, a bad prompts file, no CUDA device for
    ``--device cuda``, or nothing to train on. Its message is meant for the user as it is."""


def check_target_family(config: DistillConfig) -> None:
    """Raises ``DistillError`` when the target's family (read from its config alone, no weights) is not
    one ``specdec distill`` makes drafts for, naming the families it does."""
    target_config = load_config(resolve_model_path(config.target, config.cache_dir))
    family = getattr(target_config, "model_type", None)
    supported = ", ".join(DISTILL_FAMILIES)
    if family not in DISTILL_FAMILIES:
        raise DistillError(
            f"cannot distill a draft for {config.target}: its model family {family!r} is not supported "
            f"(supported families: {supported})"
        )
    reason = ragged_unsupported(target_config)
    if reason is not None:
        raise DistillError(f"cannot distill a draft for {config.target} ({family}): {reason}")


def read_prompt_file(path: Path) -> list[Prompt]:
    """Prompts of a JSONL file with ``{"prompt": ...}`` or ``{"messages": [...]}`` lines."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            category = str(obj.get("category", "extra"))
            if "prompt" in obj:
                prompts.append(Prompt(category, text=obj["prompt"]))
            else:
                prompts.append(Prompt(category, messages=tuple((m["role"], m["content"]) for m in obj["messages"])))
    return prompts


def _references(target: LoadedModel, prompts: list[Prompt], folder: Path, config: DistillConfig, pad_id: int) -> list:
    """The target's greedy continuations of evaluation prompts (collected once, then reused)."""
    ids = [p.render(target.tokenizer) for p in prompts]
    plan = CollectPlan(config.batch_size, config.eval_max_new, (0.0,), config.seed)
    collect(
        target.model,
        ids,
        folder,
        plan,
        target.eos_token_ids,
        pad_id,
        desc=f"references {folder.name}",
        bar=config.progress,
    )
    return load_shards(folder)


def _card(
    config: DistillConfig,
    target: LoadedModel,
    target_hash: str,
    arch,
    data: dict,
    training: dict,
    metrics: dict,
    timing: dict,
) -> dict:
    return {
        "kind": config.kind,
        "format": 1,
        # The family names the decoder layers the draft is built of; the dtype is the one the target
        # computed its labels and features in.
        "target": {
            "name": config.target,
            "weights_sha256": target_hash,
            "vocab_size": target.vocab_size,
            "tokenizer_fingerprint": target.fingerprint,
            "family": target.model.config.model_type,
            "dtype": str(target.dtype).removeprefix("torch."),
        },
        "architecture": arch.to_json(),
        "recipe": {"command": config.command, "seed": config.seed, "settings": config.recipe(), "data": data},
        "training": training,
        "timing": timing,
        "metrics": metrics,
    }


def run(config: DistillConfig) -> dict | None:
    """Runs the whole pipeline and writes the draft and its card to ``config.out``; returns the card
    (``None`` when ``config.collect_only`` stops it after collection)."""
    if config.kind not in (KIND, FEATURE_KIND):
        raise ValueError(f"unknown draft kind {config.kind!r} (expected {KIND!r} or {FEATURE_KIND!r})")
    check_target_family(config)
    try:
        placement = resolve_placement(config.device, config.dtype)
    except DeviceUnavailable as e:
        raise DistillError(str(e)) from None
    # A bad prompts file is refused before the target loads (minutes on a large one).
    user = None
    if config.prompts_file is not None:
        try:
            user = load_user_prompts(config.prompts_file, config.held_out_share, config.held_out_cap, config.seed)
        except (PromptFileError, OSError) as e:
            raise DistillError(str(e)) from None
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    started = time.monotonic()
    budget_end = started + 60 * config.minutes
    config.work.mkdir(parents=True, exist_ok=True)
    if not config.resume and any(config.work.iterdir()):
        raise FileExistsError(f"{config.work} holds an earlier run: pass --resume to continue it, or remove it")

    # Loaded in float32 because the weights hash is over float32 values; then it computes (references,
    # collection, features) in the run's dtype on its device.
    target = load_model(config.target, config.cache_dir, dtype=torch.float32)
    target.model.requires_grad_(False)
    target_hash = target_weights_hash(target.model)
    borrowed = None if (placement.device, placement.dtype) == ("cpu", torch.float32) else _borrowed(target.model)
    target.model.to(device=placement.device, dtype=placement.dtype)
    target = replace(target, dtype=placement.dtype)
    tokenizer = target.tokenizer
    pad_id = target.pad_id

    # Prompts: a collected data folder, the user's file, or a seeded built-in set; split into training and
    # held-out prompts.
    if config.data is not None:
        train_prompts, held_prompts = [], _per_category(corpus.load_prompts(Paths(config.data).held_out), config)
        source = {"kind": "data folder", "path": str(config.data)}
    elif user is not None:
        train_prompts, held_prompts = list(user.train), list(user.held_out)
        source = user.record()
        log.info(
            "%d prompts from %s (%d conversations), %d held out",
            len(train_prompts) + len(held_prompts),
            config.prompts_file,
            user.conversations,
            len(held_prompts),
        )
    else:
        stdlib = harvest_stdlib()
        prompts = build_prompts(config.prompts, config.seed, stdlib)
        train_prompts, held_prompts = split_prompts(prompts, config.held_out, config.seed)
        source = {"kind": "built-in", "prompts": len(prompts), "held_out": config.held_out}
        log.info(
            "%d prompts (%d stdlib functions harvested), %d held out", len(prompts), len(stdlib), len(held_prompts)
        )
    _, held_prompts, held_too_long = _fitting(held_prompts, tokenizer, target.max_context - config.eval_max_new)
    references = _references(target, held_prompts, config.work / "eval-held-out", config, pad_id)
    t_collect = time.monotonic()
    if config.data is not None:
        # Collected beforehand (specdec distill-data): no collection here, up to --tokens of it trained on.
        train_prompts, stored, collected = [], [], 0
        for prompt, sample in training_pairs(config.data, config.seed):
            if collected + sample.generated > config.tokens:
                break
            train_prompts.append(prompt)
            stored.append(sample)
            collected += sample.generated
        before = collected
        generate_s, train_too_long = 0.0, 0
    else:
        collected, before, generate_s, train_prompts, train_too_long = _collect_training(
            config, target, train_prompts, pad_id, started, t_collect
        )
    if config.collect_only:
        return None
    samples = stored if config.data is not None else load_shards(config.work / "data")
    collect_s = time.monotonic() - t_collect
    used = train_prompts[: len(samples)]
    if user is not None:
        source["too_long_dropped"] = held_too_long + train_too_long

    data = {
        "prompt_source": source,
        "prompts": _describe_source(config),
        "continuations": _describe_continuations(config, placement),
        "train_prompts": len(samples),
        "train_prompt_categories": _counts(p.category for p in used),
        "train_generated_tokens": sum(s.generated for s in samples),
        "train_total_tokens": sum(len(s.tokens) for s in samples),
        "held_out_prompts": len(held_prompts),
        "held_out_generated_tokens": sum(s.generated for s in references),
        "categories": _by_category(train_prompts, samples, held_prompts, references),
    }
    log.info("training data: %s", {k: v for k, v in data.items() if isinstance(v, int)})
    held_categories = [p.category for p in held_prompts]

    # The draft's head: the most frequent target tokens of the training data (frozen once chosen).
    head_path = config.work / "head_ids.pt"
    if config.resume and head_path.exists():
        head_ids = torch.load(head_path)
    elif config.init_draft is not None:  # a warm start keeps its source's head
        head_ids = source_head_ids(config.init_draft)
        torch.save(head_ids, head_path)
    else:
        head_ids = top_tokens(samples, min(config.head_size, target.vocab_size), target.eos_token_ids)
        torch.save(head_ids, head_path)
    extra = {
        Path(path).name: _references(
            target, read_prompt_file(path), config.work / f"eval-{Path(path).stem}", config, pad_id
        )
        for path in config.extra_eval
    }
    tconf = TrainConfig(
        lr=config.lr,
        epochs=config.epochs,
        batch_tokens=config.batch_tokens,
        max_len=config.max_len,
        soft_weight=config.soft_weight,
        seed=config.seed,
    )
    common = (config, target, samples, references, held_categories, extra, head_ids, tconf, budget_end, placement)
    common += (borrowed,)
    if config.kind == FEATURE_KIND:
        draft, arch, training, metrics, train_s = _train_feature(*common, target_hash)
    else:
        draft, arch, training, metrics, train_s = _train_token(*common)
    metrics["head_coverage_of_train_labels"] = _coverage(samples, head_ids)
    timing = {
        "collect_s": round(collect_s, 1),
        "train_s": round(train_s, 1),
        "total_s": round(time.monotonic() - started, 1),
        "threads": config.threads,
        "device": placement.device,
        "dtype": placement.dtype_name,
        "train_autocast": str(placement.train_dtype).removeprefix("torch."),
        # This run's own collection only (a resumed run's earlier shards took earlier time).
        "collected_tokens_this_run": collected - before,
        "collect_tokens_per_s": round((collected - before) / max(1e-9, generate_s), 1) if collected > before else None,
    }
    card = _card(config, target, target_hash, arch, data, training, metrics, timing)
    (config.out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    log.info("held-out: %s", metrics["held_out"])
    return card


@dataclass(frozen=True)
class Borrowed:
    """The float32 values of the target weights a draft borrows: the embedding, and the LM head when
    it is not tied to it (None when tied)."""

    embedding: torch.Tensor
    head: torch.Tensor | None


def _borrowed(model) -> Borrowed:
    """Float32 host copies of the weights a draft borrows, kept before the target is cast: the draft
    is trained and scored with the values it will be served with, not their bf16 roundings."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is None or head.weight.data_ptr() == embedding.data_ptr()
    return Borrowed(
        embedding.detach().to("cpu", torch.float32, copy=True),
        None if tied else head.weight.detach().to("cpu", torch.float32, copy=True),
    )


def _for_drafting(target: LoadedModel, device: str, borrowed: Borrowed | None = None) -> None:
    """Readies the target for the draft built around it once the target's own passes are over.

    A draft keeps the target's embedding module by reference (outside its module tree) and cuts its
    head rows from the LM head, so these go where the draft computes, in float32 (the draft's
    weights' dtype) and, with ``borrowed``, back to their original values; the rest of the target is
    never run again and stays as it is.
    """
    embedding = target.model.get_input_embeddings()
    if borrowed is not None:
        embedding.weight.data = borrowed.embedding.to(device)
        if borrowed.head is not None:
            target.model.get_output_embeddings().weight.data = borrowed.head.to(device)
    embedding.to(device=device, dtype=torch.float32)


def _place(draft, target: LoadedModel, device: str):
    """``draft`` (and the target embedding it reads) moved to ``device``."""
    _for_drafting(target, device)
    return draft.to(device)


def _train_token(
    config,
    target,
    samples,
    references,
    held_categories,
    extra,
    head_ids,
    tconf,
    budget_end,
    placement: Placement,
    borrowed: Borrowed | None,
):
    """Trains, evaluates and saves a token draft; returns (draft, arch, training, metrics, seconds).

    Training runs on the run's device; evaluation and the step timing on the CPU, where the figures
    are comparable between runs."""
    arch = TokenDraftArch(config.layers, config.init_from, len(head_ids))
    _for_drafting(target, placement.device, borrowed)  # the target's own passes are over
    draft = _place(build_token_draft(target.model, head_ids, arch), target, "cpu")
    untrained = evaluate(draft, references)
    examples = make_examples(samples, draft.vocab_to_head, config.max_len, prompt_weight=config.prompt_weight)
    t_train = time.monotonic()
    training = train(
        _place(draft, target, placement.device),
        token_batcher(examples, tconf),
        token_loss(tconf),
        tconf,
        config.work / f"checkpoint-{config.kind}.pt",
        deadline=budget_end,
        resume=config.resume,
        placement=placement,
        bar=config.progress,
    )
    train_s = time.monotonic() - t_train
    draft = _place(draft, target, "cpu")
    draft.requires_grad_(False)
    tallies = token_tallies(draft, references)
    metrics = {
        "held_out": summarise(tallies, 4),
        "held_out_by_category": summarise_by_category(tallies, held_categories, 4),
        "held_out_untrained": untrained,
    }
    for name, refs in extra.items():
        metrics[f"extra:{name}"] = evaluate(draft, refs)
    context = references[0].tokens[: references[0].prompt_len] if references else [0, 1, 2]
    metrics["ms_per_draft_step"] = ms_per_step(draft, context)
    save_token_draft(draft, config.out)
    return draft, arch, training, metrics, train_s


def _train_feature(
    config,
    target,
    samples,
    references,
    held_categories,
    extra,
    head_ids,
    tconf,
    budget_end,
    placement: Placement,
    borrowed: Borrowed | None,
    target_hash,
):
    """Extracts the target's features, then trains, evaluates and saves a feature draft."""
    sides = {"side_layers": config.side_layers, "bar": config.progress}
    # Every target pass comes before the draft is built around the target's embedding.
    features = extract_features(target.model, samples, config.work / "features-data", **sides)
    ref_features = extract_features(target.model, references, config.work / "features-eval-held-out", **sides)
    extra_features = {
        name: extract_features(target.model, refs, config.work / f"features-eval-{Path(name).stem}", **sides)
        for name, refs in extra.items()
    }
    arch = FeatureDraftArch(head_size=len(head_ids), side_layers=config.side_layers)
    _for_drafting(target, placement.device, borrowed)
    draft = _place(build_feature_draft(target.model, head_ids, arch), target, "cpu")
    start = None if config.init_draft is None else warm_start(draft, config.init_draft, target_hash)
    before = evaluate_feature(draft, references, ref_features)
    examples = make_feature_examples(samples, features, draft.vocab_to_head, config.max_len, config.prompt_weight)
    t_train = time.monotonic()
    training = train(
        _place(draft, target, placement.device),
        feature_batcher(examples, config.batch_tokens),
        lambda d, b: feature_loss(d, b, config.soft_weight, steps=config.rollout_steps),
        tconf,
        config.work / f"checkpoint-{config.kind}.pt",
        deadline=budget_end,
        resume=config.resume,
        placement=placement,
        bar=config.progress,
    )
    train_s = time.monotonic() - t_train
    draft = _place(draft, target, "cpu")
    draft.requires_grad_(False)
    if start is not None:
        training["started_from"] = start
    tallies = feature_tallies(draft, references, ref_features)
    metrics = {
        "held_out": summarise(tallies, 4),
        "held_out_by_category": summarise_by_category(tallies, held_categories, 4),
        # Before this run's training: the target's own layer, or the draft it started from.
        ("held_out_untrained" if start is None else "held_out_start"): before,
        # As the draft service serves it by default: prompt lookup first.
        "held_out_with_lookup": evaluate_feature(draft, references, ref_features, lookup_min=DraftConfig.lookup_min),
    }
    for name, refs in extra.items():
        metrics[f"extra:{name}"] = evaluate_feature(draft, refs, extra_features[name])
    save_feature_draft(draft, config.out)
    return draft, arch, training, metrics, train_s


def _per_category(prompts: list[Prompt], config: DistillConfig) -> list[Prompt]:
    """At most ``held_out_cap`` prompts of each category, in order (every reference costs a generation)."""
    seen: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        seen[prompt.category] = seen.get(prompt.category, 0) + 1
        if seen[prompt.category] <= config.held_out_cap:
            kept.append(prompt)
    return kept


def _collect_training(
    config: DistillConfig,
    target: LoadedModel,
    train_prompts: list[Prompt],
    pad_id: int,
    started: float,
    t_collect: float,
) -> tuple[int, int, float, list[Prompt], int]:
    """Collects the target's continuations of the training prompts into ``work/data``; returns the tokens
    there, those there before, the seconds generating, the prompts that fit and how many did not."""
    train_prompts = train_prompts[config.prompt_offset :]
    longest = target.max_context - config.max_new
    train_ids, train_prompts, train_too_long = _fitting(train_prompts, target.tokenizer, longest)
    plan = CollectPlan(config.batch_size, config.max_new, config.temperatures, config.seed)
    collect_deadline = started + 60 * config.minutes * config.collect_share
    before = sum(s.generated for s in load_shards(config.work / "data")) if config.resume else 0
    t_generate = time.monotonic()
    collected = collect(
        target.model,
        train_ids,
        config.work / "data",
        plan,
        target.eos_token_ids,
        pad_id,
        token_budget=config.tokens,
        deadline=collect_deadline,
        desc="collect",
        bar=config.progress,
    )
    generate_s = time.monotonic() - t_generate
    if collected > before:
        log.info(
            "collected %d tokens in %.0f s: %.1f tokens/s",
            collected - before,
            generate_s,
            (collected - before) / max(1e-9, generate_s),
        )
    if collected == 0:
        # Training on nothing would still write a draft, and its card would look like a result.
        raise DistillError(
            f"collection produced 0 training tokens: {_why_nothing(config, len(train_ids), started, t_collect)}"
        )
    return collected, before, generate_s, train_prompts, train_too_long


def _fitting(prompts: list[Prompt], tokenizer, longest: int) -> tuple[list[list[int]], list[Prompt], int]:
    """The rendered prompts of at most ``longest`` tokens (room left in the target's context for the
    continuation), those prompts, and how many were dropped as too long."""
    ids, kept = [], []
    for prompt in prompts:
        rendered = prompt.render(tokenizer)
        if len(rendered) <= longest:
            ids.append(rendered)
            kept.append(prompt)
    return ids, kept, len(prompts) - len(kept)


def _describe_continuations(config: DistillConfig, placement: Placement) -> str:
    """How the training continuations were made, in words, for the card."""
    if config.data is not None:
        return (
            f"the target's own answers in {config.data} (specdec distill-data: the serving pass, continuously "
            "batched, greedy and sampled at temperature 0.8 / top-p 0.95); labels are the target's argmax at "
            "every generated position"
        )
    return (
        f"target's own, batch {config.batch_size}, left padding, up to {config.max_new} new tokens, "
        f"temperatures cycled per batch {list(config.temperatures)} (0 = greedy), {placement.dtype_name} on "
        f"{placement.device}; labels are the target's argmax (and top-16 logits) at every generated position, "
        "and its argmax over the prompt"
    )


def _describe_source(config: DistillConfig) -> str:
    """What the prompts were, in words, for the card."""
    if config.data is not None:
        return f"the broad request corpus of {config.data} (draft_service.distill.corpus), by category"
    if config.prompts_file is not None:
        return (
            f"the user's prompts file {config.prompts_file}: one prompt per user turn (the conversation up to "
            "and including it; logged assistant turns are context only), split by conversation per category "
            "(draft_service.distill.user_prompts)"
        )
    return (
        "templated instructions (code, chat, summarisation, QA, maths, translation) and Python "
        "standard-library signatures/docstrings/sources, built by draft_service.distill.prompts with the seed"
    )


def _by_category(train_prompts: list[Prompt], samples, held_prompts: list[Prompt], references) -> dict[str, dict]:
    """Per category: training prompts available and continued, held-out prompts, and generated tokens."""
    out: dict[str, dict] = {}

    def entry(category: str) -> dict:
        return out.setdefault(
            category,
            {
                "train_prompts_available": 0,
                "train_prompts": 0,
                "train_generated_tokens": 0,
                "held_out_prompts": 0,
                "held_out_generated_tokens": 0,
            },
        )

    for prompt in train_prompts:
        entry(prompt.category)["train_prompts_available"] += 1
    for prompt, sample in zip(train_prompts, samples):  # shards hold the prompts' continuations in order
        entry(prompt.category)["train_prompts"] += 1
        entry(prompt.category)["train_generated_tokens"] += sample.generated
    for prompt, sample in zip(held_prompts, references):
        entry(prompt.category)["held_out_prompts"] += 1
        entry(prompt.category)["held_out_generated_tokens"] += sample.generated
    return dict(sorted(out.items()))


def _why_nothing(config: DistillConfig, prompts: int, started: float, t_collect: float) -> str:
    """Why a collection can have produced no token, and what to change."""
    if prompts == 0:
        return (
            f"no training prompt is left of --prompts {config.prompts} after --held-out {config.held_out} "
            f"and --prompt-offset {config.prompt_offset}"
        )
    if config.tokens <= 0:
        return f"--tokens is {config.tokens}"
    budget = 60 * config.minutes * config.collect_share
    return (
        f"its budget ({config.collect_share:g} of --minutes {config.minutes:g}: {budget:.0f} s) was spent before "
        f"it began (loading the target and the held-out references took {t_collect - started:.0f} s); raise --minutes"
    )


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def _coverage(samples, head_ids: torch.Tensor) -> float:
    head = set(head_ids.tolist())
    labels = [t for s in samples for t in s.labels]
    return round(sum(t in head for t in labels) / max(1, len(labels)), 4)
