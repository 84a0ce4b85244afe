"""The broad request corpus: tens of thousands of distinct requests a served target really gets.

Four sources, none a published evaluation set and none ``bench/prompts.jsonl``:

- **Composed requests**: a seeded product of who asks (``PERSONAS``), about what (``SUBJECTS``), for
  which task (questions, writing, advice, code in 18 languages, maths, translation), how long and in
  which format (``draft_service.distill.corpus_fillers``), beside the templated prompt set of
  ``draft_service.distill.prompts``.
- **Passages from this machine's own text**: Python's reference documentation (``pydoc_data``) and
  module docstrings, Debian's package descriptions and licences, to summarise, explain, question or
  translate: long inputs, as retrieval-style requests have.
- **Self-instruct**: the target itself writes user requests from a seeded persona and subject
  (``meta_prompts``, ``parse_request``); its requests join the corpus.
- **Follow-ups**: a second user turn after the target's own answer (``follow_up``).

Requests are de-duplicated by their text, and a held-out share of every category is set aside
(``split_held_out``) before anything is collected or trained. The corpus is stored as gzipped JSONL
(``save_prompts``), so a later run on another machine reads the same requests.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from draft_service.distill import corpus_fillers as C
from draft_service.distill import prompts as P
from draft_service.distill.prompts import Prompt

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly tutor who explains things step by step.",
    "You are an expert software engineer.",
    "You are a careful assistant that answers in plain English.",
)

PASSAGE_WORDS = (40, 220)
"""Passages are cut to this many words: long enough to summarise, short enough to stay cheap."""


def _words(text: str) -> int:
    return len(text.split())


def _chunks(text: str, lo: int, hi: int) -> list[str]:
    """Paragraph groups of ``lo`` to ``hi`` words (a longer paragraph is cut at a sentence)."""
    out: list[str] = []
    current: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        if _words(para) > hi:
            sentences = re.split(r"(?<=[.!?])\s+", para)
            para = ""
            for s in sentences:
                if _words(para) + _words(s) > hi:
                    break
                para = f"{para} {s}".strip()
            if not para:
                continue
        if current and _words(" ".join(current)) + _words(para) > hi:
            out.append("\n\n".join(current))
            current = []
        current.append(para)
        if _words(" ".join(current)) >= lo:
            out.append("\n\n".join(current))
            current = []
    if current and _words(" ".join(current)) >= lo:
        out.append("\n\n".join(current))
    return out


def _dpkg_descriptions(path: Path = Path("/var/lib/dpkg/status")) -> list[str]:
    """Debian package descriptions (synopsis and long text) of the installed packages."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found = []
    stanza = r"^Package: (\S+)\n(?:.*\n)*?Description: (.*)\n((?: .*\n)*)"
    for package, synopsis, body in re.findall(stanza, text, re.M):
        lines = [line[1:] for line in body.splitlines()]
        long = "\n".join("" if line.strip() == "." else line for line in lines)
        if _words(long) >= PASSAGE_WORDS[0] // 2:
            found.append(f"{package}: {synopsis}\n\n{long}")
    return found


def _licences(folder: Path = Path("/usr/share/common-licenses")) -> list[str]:
    texts = []
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def _python_docs() -> list[str]:
    """Python's language and library reference topics, as ``help()`` shows them."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[name] for name in sorted(topics)]


def _module_docstrings() -> list[str]:
    """Module docstrings of the standard library (the first lines of each ``.py`` file's docstring)."""
    import ast

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    docs = []
    for path in sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip)):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if doc and _words(doc) >= PASSAGE_WORDS[0]:
            docs.append(doc)
    return docs


def machine_passages() -> list[tuple[str, str]]:
    """``(source, passage)`` pairs cut from the text this machine ships, in a fixed order."""
    sources = {
        "python-docs": _python_docs(),
        "python-modules": _module_docstrings(),
        "debian-packages": _dpkg_descriptions(),
        "licences": _licences(),
    }
    lo, hi = PASSAGE_WORDS
    out = []
    for name, texts in sources.items():
        for text in texts:
            out.extend((name, chunk) for chunk in _chunks(text, lo if name != "debian-packages" else lo // 2, hi))
    return out


# ---------------------------------------------------------------- composed requests


def _subjects(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(C.SUBJECTS, 2)
    return a, b


def _dress(r: random.Random, category: str, content: str) -> Prompt:
    """The user message, sometimes after a system prompt."""
    messages: tuple[tuple[str, str], ...] = (("user", content),)
    if r.random() < 0.25:
        messages = (("system", r.choice(SYSTEM_PROMPTS)), *messages)
    return Prompt(category, messages=messages)


def _framed(r: random.Random, frames: Sequence[str], category: str) -> Prompt:
    subject, subject2 = _subjects(r)
    persona, persona2 = r.sample(C.PERSONAS, 2)
    text = r.choice(frames).format(subject=subject, subject2=subject2, persona=persona, persona2=persona2)
    return _dress(r, category, text + r.choice(C.LENGTHS) + r.choice(C.FORMATS))


def ask(r: random.Random) -> Prompt:
    """A question about a subject, from a persona, with a length and format."""
    return _framed(r, C.ASK_FRAMES, "ask")


def write(r: random.Random) -> Prompt:
    """Creative and practical writing: stories, poems, emails, posts, speeches."""
    return _framed(r, C.WRITE_FRAMES, "writing")


def advice(r: random.Random) -> Prompt:
    """Personal advice and planning."""
    return _framed(r, C.ADVICE_FRAMES, "advice")


def code(r: random.Random) -> Prompt:
    """Code in one of 18 languages."""
    frame = r.choice(C.CODE_FRAMES)
    text = frame.format(language=r.choice(C.CODE_LANGUAGES), task=r.choice(C.CODE_ACTIONS))
    return _dress(r, "code", text + r.choice(["", "", " Keep it short.", " Explain the code afterwards."]))


def passage_task(r: random.Random, passages: list[tuple[str, str]]) -> Prompt:
    """Summarise, explain, question or translate a passage of this machine's text."""
    _, passage = r.choice(passages)
    text = r.choice(C.PASSAGE_TASKS).format(passage=passage, language=r.choice(C.LANGUAGES))
    return _dress(r, "passage", text)


def translate(r: random.Random, passages: list[tuple[str, str]]) -> Prompt:
    """Translation of a sentence (from the templated set or a passage) into one of several languages."""
    if r.random() < 0.5 or not passages:
        return Prompt("translation", messages=P.translation(r).messages)
    _, passage = r.choice(passages)
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(passage.split())) if 5 <= _words(s) <= 30]
    if not sentences:
        return Prompt("translation", messages=P.translation(r).messages)
    frame = r.choice(["Translate into {lang}: {s}", "Please translate this into {lang}.\n\n{s}", 'In {lang}: "{s}"'])
    return _dress(r, "translation", frame.format(lang=r.choice(C.LANGUAGES), s=r.choice(sentences)))


def maths(r: random.Random) -> Prompt:
    """A word problem or calculation (the templated set's)."""
    return Prompt("maths", messages=P.maths(r).messages)


def templated(r: random.Random) -> Prompt:
    """One of the templated prompt set's generators (chat, multi-turn chat, QA, code fixes)."""
    names = ["chat_single", "chat_multi", "qa_passage", "qa_open", "code_fix", "code_explain", "code_howto"]
    prompt = P.GENERATORS[r.choice(names)][1](r)
    return Prompt("chat" if prompt.category.startswith("chat") else prompt.category, prompt.text, prompt.messages)


MIX: Mapping[str, float] = MappingProxyType(
    {
        "ask": 0.20,
        "writing": 0.12,
        "advice": 0.08,
        "code": 0.14,
        "passage": 0.14,
        "translation": 0.08,
        "maths": 0.08,
        "templated": 0.10,
        "stdlib": 0.06,
    }
)
"""Share of each composed kind; the self-instruct and follow-up requests come on top."""


def compose(n: int, seed: int, passages: list[tuple[str, str]] | None = None) -> list[Prompt]:
    """``n`` distinct composed requests, deterministic in ``seed`` (and the machine's passages)."""
    r = random.Random(seed)
    passages = machine_passages() if passages is None else passages
    stdlib = P.harvest_stdlib()
    makers = {
        "ask": ask,
        "writing": write,
        "advice": advice,
        "code": code,
        "passage": lambda r: passage_task(r, passages) if passages else ask(r),
        "translation": lambda r: translate(r, passages),
        "maths": maths,
        "templated": templated,
        "stdlib": lambda r: P.stdlib_prompt(r, r.choice(stdlib)) if stdlib else code(r),
    }
    kinds, weights = list(MIX), list(MIX.values())
    return _distinct(lambda: makers[r.choices(kinds, weights)[0]](r), n)


def _distinct(make, n: int) -> list[Prompt]:
    out: list[Prompt] = []
    seen: set[str] = set()
    for _ in range(50 * n):
        if len(out) >= n:
            break
        prompt = make()
        key = _normal(prompt.key)
        if key not in seen:
            seen.add(key)
            out.append(prompt)
    return out


def _normal(text: str) -> str:
    """De-duplication key: case and whitespace do not make two requests distinct."""
    return " ".join(text.lower().split())


# ---------------------------------------------------------------- self-instruct and follow-ups


def meta_prompts(n: int, seed: int) -> list[Prompt]:
    """``n`` distinct requests asking the target to write a user's request (category ``meta``)."""
    r = random.Random(seed + 7)

    def make() -> Prompt:
        frame = r.choice(C.SELF_INSTRUCT_FRAMES)
        text = frame.format(persona=r.choice(C.PERSONAS), subject=r.choice(C.SUBJECTS))
        return Prompt("meta", messages=(("user", text),))

    return _distinct(make, n)


_LEADS = re.compile(r"^(?:(?:question|request|message|instruction|user|task)\s*:\s*|\d+[.)]\s*|[-*]\s*)", re.I)


def parse_request(text: str) -> str | None:
    """The request the target wrote for a meta prompt, or None when it wrote something else.

    Takes the first quoted request if the target framed one (``A nurse might ask: "..."``), else
    the first non-empty line without a leading label (``Question:``), and keeps it only when it reads
    as a request: 4 to 60 words, not an assistant's opening, a refusal or talk about the task.
    """
    quoted = re.search(r'["“]([^"“”]{12,400})["”]?', text)
    line = quoted.group(1) if quoted else next((s.strip() for s in text.splitlines() if s.strip()), "")
    line = _LEADS.sub("", line).strip().strip("\"“”'*").strip()
    if not 4 <= _words(line) <= 60:
        return None
    if line.lower().startswith(_NOT_REQUESTS):
        return None
    return line


_NOT_REQUESTS = (
    "i'm sorry",
    "i cannot",
    "i can't",
    "as an ai",
    "sure",
    "certainly",
    "here is",
    "here's",
    "i'm here",
    "i'm ready",
    "to assist",
    "to write",
    "what a ",
    "please provide",
)


def self_instructed(requests: list[str], seed: int) -> list[Prompt]:
    """The target's own requests as user prompts (category ``self-instruct``), de-duplicated."""
    r = random.Random(seed + 11)
    out: list[Prompt] = []
    seen: set[str] = set()
    for text in requests:
        if text.strip() and _normal(text) not in seen:
            seen.add(_normal(text))
            out.append(_dress(r, "self-instruct", text))
    return out


def follow_up(r: random.Random, prompt: Prompt, answer: str, pool: list[Prompt]) -> Prompt:
    """A second user turn after the target's ``answer`` to ``prompt`` (category ``multi-turn``):
    a follow-up on the answer, or a new request from ``pool``."""
    assert prompt.messages is not None
    frame = r.choice(C.FOLLOW_UP_FRAMES)
    other = r.choice(pool).messages if pool else None
    request = other[-1][1] if other else "Can you say that again?"
    text = frame.format(language=r.choice(C.LANGUAGES), request=request)
    return Prompt("multi-turn", messages=(*prompt.messages, ("assistant", answer.strip()), ("user", text)))


# ---------------------------------------------------------------- held-out split and storage


def split_held_out(prompts: list[Prompt], share: float, cap: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """A seeded split into (train, held-out): ``share`` of each category (at least one where it has
    two or more, at most ``cap``), so every category is measured."""
    r = random.Random(seed + 3)
    by_category: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(i)
    held: set[int] = set()
    for category in sorted(by_category):
        members = by_category[category]
        count = min(cap, max(1 if len(members) >= 2 else 0, round(share * len(members))))
        held.update(r.sample(members, count))
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]


def save_prompts(path: Path, prompts: list[Prompt]) -> None:
    """Writes prompts as gzipped JSONL (``category`` and ``messages`` or ``text``), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8", compresslevel=9) as f:
        for p in prompts:
            record: dict = {"category": p.category}
            if p.text is not None:
                record["text"] = p.text
            else:
                assert p.messages is not None
                record["messages"] = [{"role": role, "content": content} for role, content in p.messages]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    partial.rename(path)


def load_prompts(path: Path) -> list[Prompt]:
    """What ``save_prompts`` wrote."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            messages = record.get("messages")
            out.append(
                Prompt(
                    record["category"],
                    text=record.get("text"),
                    messages=tuple((m["role"], m["content"]) for m in messages) if messages is not None else None,
                )
            )
    return out
