"""RULER's 13 tasks (NVIDIA/RULER: scripts/synthetic.yaml, scripts/data/synthetic/constants.py and the
generators niah.py, variable_tracking.py, common_words_extraction.py, freq_words_extraction.py, qa.py),
rebuilt here: their templates and answer prefixes, needle and value types, haystacks, length fitting
and generation budgets.

A prompt is the model's chat wrapping of the task template (its chat template with one user turn, when
it has one; as RULER's model templates) followed by the task's answer prefix, so the model continues
the answer. Its haystack is grown, as RULER's generators do, to the largest size (sentences, words or
documents) whose prompt plus the task's `tokens_to_generate` fits the target length in the model's
tokens: a binary search once per (task, length), then each sample shrinks it until it fits (by 1%
steps, where RULER steps back by its search increment). Every sample draws from its own generator
seeded by (seed, task, length, index), so a prompt does not depend on which process builds it or on
the other samples (RULER draws all of a task's samples from one stream; the distributions are the
same, the draws are not).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ...errors import ConfigError
from . import words as W

# scripts/data/synthetic/constants.py: the base tasks' templates, answer prefixes and generation budgets
BASE_TASKS = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                    "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                    "above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any "
                    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                    "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: "
                    "{query}",
        "answer_prefix": " Answer:",
    },
}


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> dict:
    return {"task": "niah", "args": {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
                                     "num_needle_k": nk, "num_needle_v": nv, "num_needle_q": nq}}


# scripts/synthetic.yaml: the 13 tasks, in RULER's order
TASKS = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": {"task": "variable_tracking", "args": {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}},
    "cwe": {"task": "common_words_extraction", "args": {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}},
    "fwe": {"task": "freq_words_extraction", "args": {"alpha": 2.0}},
    "qa_1": {"task": "qa", "args": {"dataset": "squad"}},
    "qa_2": {"task": "qa", "args": {"dataset": "hotpotqa"}},
}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DOCUMENT = "Document {i}:\n{document}"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)): 40 insertion depths (%)
DEFAULT_SEED = 42  # RULER's --random_seed


def tokens_to_generate(task: str) -> int:
    return BASE_TASKS[TASKS[task]["task"]]["tokens_to_generate"]


def needs(task: str) -> str | None:
    """What outside data a task needs: 'essays' (Paul Graham essays), 'squad' or 'hotpotqa', or None."""
    cfg = TASKS[task]
    if cfg["task"] == "qa":
        return cfg["args"]["dataset"]
    return "essays" if cfg["args"].get("type_haystack") == "essay" else None


def haystack_of(task: str) -> str:
    """The haystack kind a task's context is made of: noise, essay, needle, words, coded words, squad, hotpotqa."""
    cfg = TASKS[task]
    return {"common_words_extraction": "words", "freq_words_extraction": "coded words"}.get(
        cfg["task"], cfg["args"].get("type_haystack") or cfg["args"].get("dataset"))


def resolve_tasks(spec) -> list[str]:
    """'all', or comma-separated task names and the groups niah, vt, cwe, fwe, qa -> task names in RULER's order."""
    from ...options import split_items

    allowed = f"all, niah, qa, or comma-separated tasks: {', '.join(TASKS)}"
    wanted: set[str] = set()
    for item in split_items("--tasks", spec, allowed):
        if item == "all":
            wanted.update(TASKS)
        elif item in TASKS:
            wanted.add(item)
        elif item in ("niah", "qa"):
            wanted.update(t for t in TASKS if t.startswith(item))
        else:
            raise ConfigError(f"--tasks: unknown task {item!r}; allowed: {allowed}")
    return [t for t in TASKS if t in wanted]


def named_tasks(spec) -> set[str]:
    """The tasks --tasks names, one by one or by group (niah, qa): each must run, or the run is an error.
    'all' names none: it means every task whose data the run was given (the others skipped, said once)."""
    from ...options import split_items

    named: set[str] = set()
    for item in split_items("--tasks", spec, "task names"):
        if item in ("niah", "qa"):
            named.update(t for t in TASKS if t.startswith(item))
        elif item in TASKS:
            named.add(item)
    return named


# ---- model template --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wrapper:
    """The model's chat wrapping of a user turn (RULER's model templates: '{task_template}' inside the
    model's own text): the text before and after the task template, and whether tokenizing the prompt adds
    the tokenizer's special tokens (not after a chat template, which writes its own)."""
    before: str = ""
    after: str = ""
    special: bool = True

    @property
    def chat(self) -> bool:
        return bool(self.before or self.after)


_MARK = "\x00RULER-TASK\x00"


def model_wrapper(tokenizer) -> Wrapper:
    """The tokenizer's chat template with one user turn and the generation prompt, split around the task;
    no chat template: the base model's template (the task alone, tokenized with special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        return Wrapper()
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=True)
    before, mark, after = text.partition(_MARK)
    if not mark:
        raise ConfigError("the tokenizer's chat template drops the user's message; pass a tokenizer without one "
                          "(--tokenizer) to use the base template")
    return Wrapper(before, after, special=False)


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def full_template(task: str, wrapper: Wrapper) -> str:
    """RULER's prepare.py: the model template around the task template, then the answer prefix."""
    base = BASE_TASKS[TASKS[task]["task"]]
    return _escape(wrapper.before) + base["template"] + _escape(wrapper.after) + base["answer_prefix"]


# ---- haystacks --------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of a text, split after '.', '!' or '?' followed by white space (RULER uses nltk's punkt
    sent_tokenize; this is a plain stand-in, so needles land between the same kind of units)."""
    return [s for s in _SENTENCE_END.split(text) if s]


def essay_words(texts: list[str]) -> list[str]:
    """RULER's essay haystack: the essays' text with white space runs made one space, split at spaces."""
    return re.sub(r"\s+", " ", "".join(texts)).split(" ")


def _take(items: list, n: int) -> list:
    """The first n items, the list repeated as often as needed (RULER's essay and document haystacks)."""
    return items[:n] if n <= len(items) else (items * -(-n // len(items)))[:n]


def _insert_in_sentences(rng: random.Random, sentences: list[str], inserts: list[str]) -> str:
    """The essay haystack's insertion: each insert between sentences at a depth drawn from DEPTHS."""
    cuts = [0] + sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(inserts))) + [len(sentences)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


# ---- the generators: (haystack size, rng) -> (prompt text, answers) ----------------------------------

@dataclass
class Data:
    """Outside data: the essay haystack's words, and the QA sets (questions, documents)."""
    essays: list[str] | None = None
    qa: dict = field(default_factory=dict)  # 'squad' / 'hotpotqa' -> (questions, documents)


def niah_text(args: dict, template: str, n: int, rng: random.Random, seed: int, data: Data) -> tuple[str, list]:
    """niah.py's generate_input_output: keys and values, their needles, the haystack (n noise sentences, n
    essay words, or n decoy needles), the query of num_needle_q keys and its answers."""
    kind_k, kind_v = args["type_needle_k"], args["type_needle_v"]
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(W.random_value(kind_k, rng))
        value = []
        for _ in range(args["num_needle_v"]):
            value.append(W.random_value(kind_v, rng))
            needles.append(NEEDLE.format(type_needle_v=kind_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)
    if args["type_haystack"] == "essay":
        text = " ".join(_take(data.essays, n))
        context = _insert_in_sentences(rng, split_sentences(text.strip()), needles)
    else:
        if args["type_haystack"] == "noise":
            sentences = [NOISE] * n
        else:  # needle: every haystack sentence is a needle of another key
            sentences = [NEEDLE.format(type_needle_v=kind_v, key=W.random_value(kind_k, rng),
                                       value=W.random_value(kind_v, rng)) for _ in range(n)]
        for at, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            sentences.insert(at, needle)
        context = "\n".join(sentences)
    asked = rng.sample(range(num_k), args["num_needle_q"])
    queries = [keys[i] for i in asked]
    answers = [a for i in asked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    type_v = kind_v
    if args["num_needle_q"] * args["num_needle_v"] == 1:  # one answer: RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        type_v = type_v[:-1]
    return template.format(type_needle_v=type_v, context=context, query=query), answers


def vt_chains(rng: random.Random, num_chains: int, num_hops: int, icl: bool) -> tuple[list, list]:
    """variable_tracking.py's chains: 'VAR A = 12345' then 'VAR B = VAR A ' ... (names of 5 capitals, 3 in
    the in-context example, whose value is always 12345), distinct names."""
    k, hops = (3, min(10, num_hops)) if icl else (5, num_hops)
    names: list[str] = []
    while len(names) < (hops + 1) * num_chains:
        name = W.random_letters(rng, k)
        if name not in names:
            names.append(name)
    var_lists, chains = [], []
    for i in range(0, len(names), hops + 1):
        vs = names[i:i + hops + 1]
        var_lists.append(vs)
        chain = [f"VAR {vs[0]} = {12345 if icl else rng.randrange(10000, 99999)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)]
        chains.append(chain)
    return var_lists, chains


def vt_text(args: dict, template: str, n: int, rng: random.Random, icl: bool = False) -> tuple[str, list]:
    """variable_tracking.py's generate_input_output on the noise haystack: the chains' lines inserted among n
    noise sentences, each chain in order."""
    var_lists, chains = vt_chains(rng, args["num_chains"], args["num_hops"], icl)
    value = chains[0][0].split("=")[-1].strip()
    sentences = [NOISE] * n
    for chain in chains:
        for j, at in enumerate(sorted(rng.sample(range(len(sentences)), len(chain)))):
            sentences.insert(at + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    hops = min(10, args["num_hops"]) if icl else args["num_hops"]
    return template.format(context=context, query=value, num_v=hops + 1), var_lists[0]


def vt_randomize_example(example: str, num_hops: int, rng: random.Random) -> str:
    """variable_tracking.py's randomize_icl: new names for the example's answer variables, a new value."""
    for name in example.strip().split()[-num_hops - 1:]:
        example = example.replace(name, W.random_letters(rng, len(name)))
    return example.replace("12345", str(rng.randrange(10000, 99999)))


def cwe_example(rng: random.Random, seed: int, num_words: int, common_repeats: int, uncommon_repeats: int,
                num_common: int) -> tuple[str, list]:
    """common_words_extraction.py's get_example: num_common words repeated common_repeats times, the others
    uncommon_repeats times, shuffled, numbered '1. w 2. w ...'."""
    pool = W.common_words(seed)
    if num_words > len(pool):
        pool = W.made_up_words()
    chosen = rng.sample(pool, num_words)
    common, uncommon = chosen[:num_common], chosen[num_common:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def cwe_text(args: dict, template: str, n: int, rng: random.Random, seed: int, length: int) -> tuple[str, list]:
    """common_words_extraction.py's generate_input_output: one solved example (its own prompt, template
    included, and its answer), then the task over n words; below 4096 tokens fewer repeats (RULER's)."""
    cw = args["num_cw"]
    if length < 4096:
        shots, (context, answer) = [cwe_example(rng, seed, 20, 3, 1, cw)], cwe_example(rng, seed, n, 6, 1, cw)
    else:
        shots = [cwe_example(rng, seed, 40, 10, 3, cw)]
        context, answer = cwe_example(rng, seed, n, args["freq_cw"], args["freq_ucw"], cw)
    solved = [template.format(num_cw=cw, context=c, query="") + " " + " ".join(f"{i + 1}. {w}" for i, w in
                                                                             enumerate(a)) for c, a in shots]
    return "\n".join(solved) + "\n" + template.format(num_cw=cw, context=context, query=""), answer


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (scipy.special.zeta, which RULER uses): a partial sum and its Euler-Maclaurin tail."""
    n = 64
    return math.fsum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def fwe_vocab(rng: random.Random, seed: int, size: int, word_len: int = 6) -> list[str]:
    """freq_words_extraction.py's coded words: `size` distinct random lowercase words, sorted, shuffled with
    the seed, the most frequent one made '...' (noise)."""
    vocab = {W.random_letters(rng, word_len, string.ascii_lowercase) for _ in range(size)}
    while len(vocab) < size:
        vocab.add(W.random_letters(rng, word_len, string.ascii_lowercase))
    vocab = sorted(vocab)
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    return vocab


def fwe_text(args: dict, template: str, num_words: int, vocab: list[str], seed: int) -> tuple[str, list]:
    """freq_words_extraction.py's gen_text: the word of rank k appears int(num_words k^-alpha / zeta(alpha))
    times (Zipf), shuffled; the answer is the three most frequent words after the noise '...'."""
    alpha = args["alpha"]
    z = zeta(alpha)
    text = [w for k, w in enumerate(vocab, 1) for _ in range(int(num_words * k ** -alpha / z))]
    random.Random(seed).shuffle(text)
    return template.format(context=" ".join(text), query=""), vocab[1:4]


def qa_text(template: str, questions: list[dict], docs: list[str], index: int, num_docs: int,
            rng: random.Random, seed: int) -> tuple[str, list]:
    """qa.py's generate_input_output: the question's own documents, then documents of the same article (SQuAD),
    then random others, up to num_docs, shuffled with the seed, numbered 'Document i:'."""
    q = questions[index]
    own, more = q["context"], q.get("more_context", [])
    if num_docs < len(docs):
        if num_docs - len(own) > len(more):
            taken = set(own) | set(more)
            others = [i for i in range(len(docs)) if i not in taken]
            chosen = own + more + rng.sample(others, max(0, num_docs - len(own) - len(more)))
        else:
            chosen = own + rng.sample(more, max(0, num_docs - len(own)))
        picked = [docs[i] for i in chosen]
    else:
        picked = _take(docs, num_docs)
    random.Random(seed).shuffle(picked)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(picked))
    return template.format(context=context, query=q["query"]), list(q["outputs"])


# ---- prompts of a (task, length) ---------------------------------------------------------------------

@dataclass
class Sample:
    """One RULER sample: its prompt (text and ids, answer prefix included), expected outputs and budget."""
    task: str
    length: int
    index: int
    text: str
    ids: list[int]
    outputs: list[str]
    tokens_to_generate: int
    answer_prefix: str
    digest: str = ""

    def __post_init__(self):
        if not self.digest:
            self.digest = hashlib.sha1(json.dumps([self.task, self.length, self.ids, self.outputs,
                                                   self.tokens_to_generate]).encode()).hexdigest()[:16]


def sample_rng(seed: int, task: str, length: int, index: int | str) -> random.Random:
    h = hashlib.sha256(f"{seed}|{task}|{length}|{index}".encode()).hexdigest()
    return random.Random(int(h[:16], 16))


class Builder:
    """Builds the samples of every (task, length) for one tokenizer and model template."""

    def __init__(self, tokenizer, wrapper: Wrapper, data: Data, seed: int = DEFAULT_SEED):
        self.tok, self.wrapper, self.data, self.seed = tokenizer, wrapper, data, seed
        self._vt_example: str | None = None
        self._last: tuple = (None, [])

    def ids(self, text: str) -> list[int]:
        if self._last[0] is not text:  # a sample's final text is counted, then tokenized: once is enough
            self._last = (text, list(self.tok(text, add_special_tokens=self.wrapper.special)["input_ids"]))
        return self._last[1]

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def samples(self, task: str, length: int, num: int) -> list[Sample]:
        cfg = TASKS[task]
        kind, args = cfg["task"], cfg["args"]
        ttg = tokens_to_generate(task)
        template = full_template(task, self.wrapper)
        if kind == "freq_words_extraction":
            texts = self._fwe(args, template, length, ttg, num, task)
        else:
            make, incremental = self._generator(task, kind, args, template, length)
            # the search's upper bound: 3x the size the tokens per haystack unit of a small probe suggest
            # (common words: 2x, probed with 4096 words, as RULER)
            probe, factor = (4096, 2) if kind == "common_words_extraction" else (incremental, 3)
            size = self._fit(make(0), incremental, length - ttg, task, length, probe, factor)
            texts = (self._shrink(make(i), size, incremental, length - ttg, task, length) for i in range(num))
        prefix = BASE_TASKS[kind]["answer_prefix"][:10]
        out = []
        for i, (text, answers) in enumerate(texts):  # each text just counted: its ids are at hand
            at = text.rfind(prefix)  # RULER's split of the answer prefix: at its first 10 characters
            out.append(Sample(task, length, i, text, self.ids(text), [str(a) for a in answers], ttg, text[at:]))
        return out

    # a task's generator: index -> (build(n, rng) -> (text, answers), the rng of sample `index`)
    def _generator(self, task: str, kind: str, args: dict, template: str, length: int):
        seed = self.seed
        if kind == "niah":
            haystack = args["type_haystack"]
            incremental = 500 if haystack == "essay" else 25
            if haystack != "essay" and length < 4096:
                incremental = 5

            def make(i):
                return lambda n, rng: niah_text(args, template, n, rng, seed, self.data)
        elif kind == "variable_tracking":
            example = self.vt_example(args)  # inside every prompt, so counted in the fitting (RULER adds its tokens)
            incremental = 5 if length < 4096 else 10
            cut = BASE_TASKS[kind]["template"][:20]

            def make(i):
                def build(n, rng):
                    text, answers = vt_text(args, template, n, rng)
                    at = text.index(cut)
                    return text[:at] + vt_randomize_example(example, args["num_hops"], rng) + "\n" + text[at:], answers
                return build
        elif kind == "common_words_extraction":
            incremental = 10

            def make(i):
                return lambda n, rng: cwe_text(args, template, n, rng, seed, length)
        else:  # qa
            incremental = 10
            name = args["dataset"]
            questions, docs = self.data.qa[name]

            def make(i):
                if i >= len(questions):
                    raise ConfigError(f"--samples: {task} ({name}) has only {len(questions)} questions")
                return lambda n, rng: qa_text(template, questions, docs, i, n, rng, seed)
        makers = {}

        def for_index(i):
            if i not in makers:
                build, rng = make(i), sample_rng(seed, task, length, i)
                makers[i] = (build, rng)
            return makers[i]
        return for_index, incremental

    def _fit(self, maker, incremental: int, budget: int, task: str, length: int, probe: int, factor: int) -> int:
        """RULER's binary search for the largest haystack size whose prompt fits `budget` tokens (each try
        drawn from the same generator state, so the size depends only on the seed, task and length)."""
        build, _ = maker
        state = sample_rng(self.seed, task, length, "fit").getstate()

        def tokens(n):
            rng = random.Random()
            rng.setstate(state)
            return self.count(build(n, rng)[0])

        per = tokens(probe) / probe
        lo, hi = incremental, max(int(budget / per) * factor, incremental * 2)
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            if tokens(mid) <= budget:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best if best is not None else incremental

    def _shrink(self, maker, size: int, incremental: int, budget: int, task: str, length: int) -> tuple[str, list]:
        """A sample at the fitted size, made smaller while its prompt does not fit (RULER's loop, finer)."""
        build, rng = maker
        while True:
            try:
                text, answers = build(size, rng)
                tokens = self.count(text)
            except ValueError:  # fewer haystack sentences than needles
                text, tokens = None, None
            if text is not None and tokens <= budget:
                return text, answers
            if size <= 1:
                what = f"its smallest prompt has {tokens} tokens" if tokens else "no room for its needles"
                raise ConfigError(f"--lengths {length}: too short for {task} ({what}; {tokens_to_generate(task)} "
                                  "more tokens are generated)")
            # RULER steps back by its search increment (500 essay words: a fifth of a 4k prompt); here 1% at a
            # time, so a sample stays near the target length; below one increment, where RULER would try
            # forever, the haystack keeps shrinking until it fits or is empty
            size = max(1, size - max(1, size // 100)) if size > incremental else size // 2

    def vt_example(self, args: dict) -> str:
        """variable_tracking.py's in-context example: a task prompt without the model template, fitted to 500
        tokens on 5-sentence steps, with its answer appended; made once per run."""
        if self._vt_example is None:
            kind = BASE_TASKS["variable_tracking"]
            bare = kind["template"] + kind["answer_prefix"]
            rng = sample_rng(self.seed, "vt", 0, "example")
            state = rng.getstate()

            def build(n, _rng=None):
                r = random.Random()
                r.setstate(state)
                return vt_text(args, bare, n, r, icl=True)

            lo, hi, best = 5, 200, None
            while lo <= hi:  # the largest haystack within 500 tokens (at least 5 sentences)
                mid = (lo + hi) // 2
                if self.count(build(mid)[0]) <= 500:
                    best, lo = mid, mid + 1
                else:
                    hi = mid - 1
            text, answers = build(best or 5)
            self._vt_example = text + " " + " ".join(answers) + "\n"
        return self._vt_example

    def _fwe(self, args: dict, template: str, length: int, ttg: int, num: int, task: str) -> Iterator[tuple[str, list]]:
        """freq_words_extraction.py's sizing: (length - tokens_to_generate) // 50 coded words; the word count
        grown from max_len // 6 in steps of max_len // 32 until the prompt reaches max_len tokens, one step
        back; each sample shrinks it while its prompt is longer than max_len."""
        max_len = length - ttg
        size, step = max(max_len // 50, 4), max(max_len // 32, 1)
        rng = sample_rng(self.seed, task, length, "fit")
        vocab = fwe_vocab(rng, self.seed, size)
        n = max_len // 6
        while self.count(fwe_text(args, template, n, vocab, self.seed)[0]) < max_len:
            n += step
        n -= step
        for i in range(num):
            vocab = fwe_vocab(sample_rng(self.seed, task, length, i), self.seed, size)
            words = n
            text, answers = fwe_text(args, template, words, vocab, self.seed)
            while self.count(text) > max_len:
                words -= step
                if words <= 0:
                    raise ConfigError(f"--lengths {length}: too short for {task}")
                text, answers = fwe_text(args, template, words, vocab, self.seed)
            yield text, answers


def build_samples(builder: Builder, tasks: list[str], lengths: list[int], num: int,
                  progress: Callable[[str, int], None] | None = None) -> list[Sample]:
    """Every (task, length)'s samples, lengths then tasks."""
    out = []
    for length in lengths:
        for task in tasks:
            out.extend(builder.samples(task, length, num))
            if progress:
                progress(task, length)
    return out
