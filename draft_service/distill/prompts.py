"""The distillation prompt set: templated instructions plus Python standard-library docstrings.

Categories: code (instructions, explanations, bug fixes, raw completions of stdlib signatures and
docstrings), chat (single and multi-turn), summarisation, QA, maths and translation. Every prompt is
made here from templates × fillers (``draft_service.distill.fillers``) or harvested from the standard
library's own sources with ``ast``; no published evaluation set and not ``bench/prompts.jsonl``.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draft_service.distill import fillers as F


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain ``text`` (no template, e.g. code to complete) or chat ``messages``."""

    category: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def key(self) -> str:
        """Identity for de-duplication and splitting."""
        if self.text is not None:
            return self.text
        return "\x1e".join(f"{r}\x1f{c}" for r, c in self.messages)

    def render(self, tokenizer) -> list[int]:
        """Token ids the target sees: the chat template with generation prompt, or the raw text."""
        if self.text is not None:
            return list(tokenizer.encode(self.text, add_special_tokens=False))
        if getattr(tokenizer, "chat_template", None) is None:  # tiny test tokenizers have none
            return list(tokenizer.encode(" ".join(c for _, c in self.messages), add_special_tokens=False))
        ids = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in self.messages], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def _user(category: str, content: str) -> Prompt:
    return Prompt(category, messages=(("user", content),))


# ---------------------------------------------------------------- code


def code_write(r: random.Random) -> Prompt:
    task, lang = r.choice(F.CODE_TASKS), r.choice(F.LANGUAGES)
    t = r.choice(
        [
            "Write a {lang} function that {task}.",
            "Can you write {lang} code that {task}?",
            "I need a {lang} function that {task}. Please add a short explanation.",
            "Show me how to write a function in {lang} that {task}.",
            "Write a short {lang} program that {task}, with comments.",
            "Implement a function that {task} in {lang}, and give one example of calling it.",
            "Write a {lang} function that {task}. Include a docstring and a test.",
        ]
    )
    return _user("code", t.format(lang=lang, task=task))


def code_explain(r: random.Random) -> Prompt:
    concept, lang = r.choice(F.CODE_CONCEPTS), r.choice(F.LANGUAGES)
    t = r.choice(
        [
            "What is {c} in {lang}?",
            "Explain {c} with a small {lang} example.",
            "When should I use {c}?",
            "Can you explain {c} to a beginner?",
            "What are the pros and cons of {c}?",
            "Give me a simple example of {c} in {lang}.",
        ]
    )
    return _user("code", t.format(c=concept, lang=lang))


def code_howto(r: random.Random) -> Prompt:
    what, lang = r.choice(F.CODE_HOWTO), r.choice(F.LANGUAGES[:6])
    t = r.choice(
        ["How do I {w} in {lang}?", "In {lang}, what is the easiest way to {w}?", "Show me how to {w} using {lang}."]
    )
    return _user("code", t.format(w=what, lang=lang))


def code_fix(r: random.Random) -> Prompt:
    code, symptom = r.choice(F.BUGGY_SNIPPETS)
    t = r.choice(
        [
            "This Python code has a bug: {s}. Can you fix it?\n\n```python\n{code}\n```",
            "Why does this code not work? {s}.\n\n```python\n{code}\n```",
            "Find and fix the mistake in this function ({s}):\n\n{code}",
        ]
    )
    return _user("code", t.format(s=symptom, code=code))


# ---------------------------------------------------------------- chat


def chat_single(r: random.Random) -> Prompt:
    t = r.choice(
        [
            "I'm {sit}. Do you have any advice?",
            "I'm {sit} and I feel a bit overwhelmed. Where should I start?",
            "What are some tips for {sit}?",
            "I want to get into {hob}. How should I begin?",
            "Can you suggest a weekly routine for {hob}?",
            "What are the benefits of {hob}?",
            "My friend says {hob} is boring. How can I convince them to try it?",
            "Give me five ideas for a relaxing weekend.",
            "What should I cook tonight with rice, eggs and spinach?",
            "Can you help me write a short thank-you note to my colleague {name}?",
            "Write a short poem about {topic}.",
            "Tell me a fun fact about {topic}.",
            "Write a friendly message inviting {name} to my birthday party on Saturday.",
            "What is a good name for a {pet}?",
            "Suggest three gift ideas for someone who loves {hob}.",
        ]
    )
    content = t.format(
        sit=r.choice(F.SITUATIONS),
        hob=r.choice(F.HOBBIES),
        name=r.choice(F.NAMES),
        topic=r.choice(F.TOPICS),
        pet=r.choice(["puppy", "kitten", "goldfish", "rabbit", "parrot"]),
    )
    return _user("chat", content)


def chat_multi(r: random.Random) -> Prompt:
    first = r.choice(["I'm {sit}.", "I'd like to start {hob}.", "I've been thinking about {hob}."]).format(
        sit=r.choice(F.SITUATIONS), hob=r.choice(F.HOBBIES)
    )
    opener = r.choice(F.ASSISTANT_OPENERS)
    follow = r.choice(F.FOLLOW_UPS)
    messages = [("user", first + " Any advice?"), ("assistant", opener), ("user", follow)]
    if r.random() < 0.3:
        messages = [("system", "You are a helpful, friendly assistant.")] + messages
    return Prompt("chat", messages=tuple(messages))


# ---------------------------------------------------------------- summarisation and QA passages


def _passage(r: random.Random) -> tuple[str, dict[str, str]]:
    """A synthetic news-style passage and the facts it states."""
    facts = {
        "place": r.choice(F.PLACES),
        "company": r.choice(F.COMPANIES),
        "product": r.choice(F.PRODUCTS),
        "event": r.choice(F.EVENTS),
        "name": r.choice(F.NAMES),
        "name2": r.choice(F.NAMES),
        "price": str(r.choice([19, 25, 49, 79, 120, 249, 399])),
        "year": str(r.randint(1890, 2023)),
        "count": str(r.choice([12, 40, 150, 300, 1200, 5000])),
        "month": r.choice(["March", "June", "September", "November"]),
        "day": r.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]),
        "hour": r.choice(["7:30", "9:00", "10:15", "14:00", "18:30"]),
    }
    kind = r.randrange(4)
    if kind == 0:
        s = [
            "{company} has announced {product}, which will go on sale in {month} for {price} euros.",
            "The company says the idea came from customer feedback collected over the past year.",
            "According to chief designer {name}, the main goal was to make it lighter and easier to repair.",
            "Early testers praised the battery life but said the instructions could be clearer.",
            "{company} expects to sell around {count} units in the first month.",
            "Competitors are expected to respond with cheaper models before the end of the year.",
        ]
    elif kind == 1:
        s = [
            "Last {day} in {place}, {event}.",
            "Local officials said the situation had been planned for carefully.",
            "{name}, who has lived in {place} since {year}, said it was the biggest change she could remember.",
            "About {count} residents attended a public meeting to discuss what happens next.",
            "Shops on the main street reported more visitors than usual.",
            "A follow-up meeting is planned for {month}, when a final report will be published.",
        ]
    elif kind == 2:
        s = [
            "The {place} community centre opens at {hour} on weekdays and closes at nine in the evening.",
            "Members pay {price} euros a year, while children under twelve can join for free.",
            "The centre was founded in {year} by {name}, a retired teacher who wanted a place for evening classes.",
            "Today it offers {count} courses, from pottery to computer skills.",
            "The most popular course is a cooking class led by {name2} on {day} evenings.",
            "A new garden behind the building will open to visitors in {month}.",
        ]
    else:
        s = [
            "Researchers at the University of {place} have studied how {topic} affects daily life.",
            "The team, led by {name}, followed {count} volunteers for two years.",
            "They found that small changes in routine had a surprisingly large effect.",
            "Participants who took part in weekly sessions reported feeling more confident.",
            "However, the researchers warn that the study was small and more work is needed.",
            "The results will be presented at a conference in {month}.",
        ]
        facts["topic"] = r.choice(F.TOPICS)
    keep = s[: r.randint(4, len(s))]
    return " ".join(x.format(**facts) for x in keep), facts


def summarise(r: random.Random) -> Prompt:
    passage, _ = _passage(r)
    t = r.choice(
        [
            "Summarise this text in two sentences:\n\n{p}",
            "Give me a short summary of the following article.\n\n{p}",
            "Please write a one-sentence summary:\n\n{p}",
            "What are the main points of this passage?\n\n{p}",
            "Summarize the following news story for a busy reader.\n\n{p}",
            "TL;DR this for me:\n\n{p}",
            "Rewrite this passage as three bullet points.\n\n{p}",
        ]
    )
    return _user("summarisation", t.format(p=passage))


def qa_passage(r: random.Random) -> Prompt:
    passage, facts = _passage(r)
    q = r.choice(
        [
            "Who is mentioned in the passage?",
            "Where does this take place?",
            "What number is mentioned in the passage?",
            "What happens in {month}?",
            "What is the main topic of the passage?",
            "Who founded it, and when?",
            "How much does it cost?",
        ]
    ).format(**facts)
    t = r.choice(
        [
            "Answer the question using the text below.\n\nText: {p}\n\nQuestion: {q}",
            "{p}\n\nBased on the passage above, {ql}",
            "Context: {p}\nQuestion: {q}\nAnswer:",
        ]
    )
    return _user("qa", t.format(p=passage, q=q, ql=q[0].lower() + q[1:]))


def qa_open(r: random.Random) -> Prompt:
    if r.random() < 0.5:
        content = r.choice(F.QUESTIONS) + r.choice(F.STYLES)
    else:
        t = r.choice(
            [
                "What is {t}?",
                "Explain {t} in simple terms.",
                "How does {t} work?",
                "Why is {t} important?",
                "Tell me three interesting facts about {t}.",
                "What are common misconceptions about {t}?",
                "Write a short paragraph about {t} for a school newsletter.",
            ]
        )
        content = t.format(t=r.choice(F.TOPICS)) + r.choice(F.STYLES)
    return _user("qa", content)


# ---------------------------------------------------------------- maths


def maths(r: random.Random) -> Prompt:
    n1, n2, n3 = r.randint(2, 30), r.randint(2, 12), r.randint(2, 60)
    name, name2, item = r.choice(F.NAMES), r.choice(F.NAMES), r.choice(F.ITEMS)
    big, small, factor = r.choice(F.UNITS)
    t = r.choice(
        [
            "{name} has {n3} {item} and gives {n1} to {name2}. How many {item} does {name} have left?",
            "A box holds {n2} {item}. How many boxes are needed for {big3} {item}?",
            "{name} buys {n2} {item} at {n1} dollars each and pays with a {bill}-dollar note. "
            "How much change does {name} get?",
            "What is {n3} multiplied by {n2}, minus {n1}?",
            "Solve for x: {n2}x + {n1} = {rhs}.",
            "A car travels {speed} kilometres per hour for {n2} hours. How far does it go?",
            "What is {pct}% of {price}?",
            "Convert {n2} {big} into {small}.",
            "The sum of two numbers is {sum} and their difference is {diff}. What are the numbers?",
            "A rectangle is {n3} cm long and {n2} cm wide. What are its area and perimeter?",
            "{name} reads {n1} pages a day. How many days does it take to read a book of {pages} pages?",
            "Is {p} a prime number? Explain why.",
            "What is the average of {n1}, {n2} and {n3}?",
            "A recipe needs {n2} eggs for {n1} people. How many eggs are needed for {n3} people?",
            "If a shirt costs {price} euros and is discounted by {pct}%, what is the new price?",
        ]
    )
    content = t.format(
        name=name,
        name2=name2,
        item=item,
        n1=n1,
        n2=n2,
        n3=n3 + n1,
        big3=n2 * n3 + r.randint(0, n2 - 1),
        bill=((n1 * n2) // 10 + 1) * 10 + 10,
        rhs=n2 * r.randint(1, 15) + n1,
        speed=r.choice([40, 60, 75, 90, 110]),
        pct=r.choice([10, 15, 20, 25, 30, 40, 50]),
        price=r.choice([20, 36, 48, 80, 120, 250]),
        big=big,
        small=small,
        sum=2 * n3 + n1,
        diff=n1,
        pages=n1 * r.randint(5, 30),
        p=r.choice([21, 29, 51, 57, 61, 89, 91, 97, 101, 117]),
    )
    content += r.choice(["", " Show your working.", " Explain step by step.", " Give only the answer.", ""])
    return _user("maths", content)


# ---------------------------------------------------------------- translation


def translation(r: random.Random) -> Prompt:
    if r.random() < 0.7:
        sentence, lang = r.choice(F.ENGLISH_SENTENCES), r.choice(F.TRANSLATION_LANGS)
        t = r.choice(
            [
                "Translate into {lang}: {s}",
                "Translate the following sentence into {lang}.\n\n{s}",
                'How do you say this in {lang}? "{s}"',
                "Please translate to {lang}:\n{s}",
            ]
        )
        return _user("translation", t.format(lang=lang, s=sentence))
    lang, sentence = r.choice(F.FOREIGN_SENTENCES)
    t = r.choice(
        [
            "Translate this {lang} sentence into English: {s}",
            'What does this mean in English? "{s}"',
            "Translate from {lang} to English:\n\n{s}",
        ]
    )
    return _user("translation", t.format(lang=lang, s=sentence))


# ---------------------------------------------------------------- the Python standard library


@dataclass(frozen=True)
class StdlibFunction:
    """A documented function of the standard library: where it lives, its signature and docstring."""

    module: str
    name: str
    signature: str
    doc: str
    source: str


@functools.lru_cache(maxsize=4)
def harvest_stdlib(max_files: int | None = None) -> tuple[StdlibFunction, ...]:
    """Public functions with docstrings from the standard library's own ``.py`` files, via ``ast``.

    Sorted by module and name so the result does not depend on the filesystem's order.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip))
    if max_files is not None:
        files = files[:max_files]
    found: list[StdlibFunction] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines()
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 25:
                continue
            doc = doc.split("\n\n")[0].strip()[:400]
            returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
            prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            signature = f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"
            short = node.end_lineno is not None and node.end_lineno - node.lineno <= 25
            body = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])) if short else ""
            found.append(StdlibFunction(module, node.name, signature, doc, body))
    found.sort(key=lambda f: (f.module, f.name, f.signature))
    return tuple(found)


def stdlib_prompt(r: random.Random, fn: StdlibFunction) -> Prompt:
    """A raw completion of a stdlib signature + docstring, or a chat question about the function."""
    roll = r.random()
    if roll < 0.5:
        doc = fn.doc.replace('"""', "'''").replace("\n", "\n    ")
        return Prompt("code-stdlib", text=f'{fn.signature}\n    """{doc}\n    """\n')
    if roll < 0.7 and fn.source:
        t = r.choice(
            [
                "Explain what this Python function does:\n\n```python\n{src}\n```",
                "Can you walk me through this code step by step?\n\n{src}",
                "Suggest one improvement to this function:\n\n```python\n{src}\n```",
            ]
        )
        return _user("code-stdlib", t.format(src=fn.source))
    t = r.choice(
        [
            'In Python\'s {mod} module, what does `{name}` do? Its documentation says: "{doc}"',
            "Write a short example that uses `{mod}.{name}`. The docstring says: {doc}",
            "Here is a function signature from the Python standard library:\n\n{sig}\n\n"
            "Documentation: {doc}\n\nExplain how to use it.",
            "Rewrite this documentation in plain English:\n\n{doc}",
            'Write a Python function with this signature and behaviour.\n\n{sig}\n    """{doc}"""',
        ]
    )
    return _user("code-stdlib", t.format(mod=fn.module, name=fn.name, doc=fn.doc, sig=fn.signature))


# ---------------------------------------------------------------- the whole set

GENERATORS: dict[str, tuple[float, Callable[[random.Random], Prompt]]] = {
    "code_write": (0.09, code_write),
    "code_explain": (0.05, code_explain),
    "code_howto": (0.05, code_howto),
    "code_fix": (0.03, code_fix),
    "chat_single": (0.11, chat_single),
    "chat_multi": (0.07, chat_multi),
    "summarise": (0.10, summarise),
    "qa_passage": (0.07, qa_passage),
    "qa_open": (0.09, qa_open),
    "maths": (0.10, maths),
    "translation": (0.09, translation),
}
STDLIB_SHARE = 0.15
"""Share of prompts harvested from the standard library (the rest are templated)."""


def build_prompts(n: int, seed: int, stdlib: tuple[StdlibFunction, ...] | None = None) -> list[Prompt]:
    """``n`` distinct prompts, deterministic in ``seed``, mixed across categories."""
    r = random.Random(seed)
    functions = stdlib if stdlib is not None else harvest_stdlib()
    names = list(GENERATORS)
    weights = [GENERATORS[k][0] for k in names]
    order = list(range(len(functions)))
    r.shuffle(order)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    attempts = 0
    while len(prompts) < n and attempts < 50 * n:
        attempts += 1
        if functions and r.random() < STDLIB_SHARE:
            prompt = stdlib_prompt(r, functions[order[len(prompts) % len(order)]])
        else:
            prompt = GENERATORS[r.choices(names, weights)[0]][1](r)
        if prompt.key not in seen:
            seen.add(prompt.key)
            prompts.append(prompt)
    return prompts


def split_prompts(prompts: list[Prompt], held_out: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """A seeded split into (train, held-out) with ``held_out`` prompts, category mix preserved."""
    r = random.Random(seed + 1)
    idx = list(range(len(prompts)))
    r.shuffle(idx)
    held = set(idx[:held_out])
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]
