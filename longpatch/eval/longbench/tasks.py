"""LongBench's task protocol (its `pred.py` and `config/*.json`): the prompt template and generation
length of each task, which tasks skip the chat format and which are scored on their first line, the
metric of each task, the model budgets, and how a prompt is built (middle truncation, chat format).

The templates are LongBench's verbatim, typos included ("asconcisely"): a prompt changed by one
character is another benchmark.
"""
from __future__ import annotations

from typing import Sequence

from ...errors import ConfigError
from .data import CATEGORY_OF, SUBSETS

PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as "
        "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
        "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n "
        "Answer the question based on the above article as concisely as you can, using a single phrase or "
        "sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", "
        "or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{inp"
        "ut}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the "
        "report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. "
        "\n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of "
        "questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some "
        "examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after "
        "removing duplicates. In other words, how many non-repeating paragraphs are there in "
        "total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing "
        "duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe "
        "final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter "
        "the number of the paragraph that the abstract is from. The answer format must be like "
        "\"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一"
        "个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是"
        "："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# new tokens generated per task (LongBench's dataset2maxlen)
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1", "dureader": "rouge_zh",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge_zh",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge", "lsht": "classification",
    "passage_retrieval_en": "retrieval", "passage_count": "count", "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim", "repobench-p": "code_sim",
}

# Prompt budgets in tokens (LongBench's model2maxlen): the trained context minus 500 for the answer.
# Keys: LongBench's model names and the hub ids / longpatch aliases they stand for.
MODEL_MAX_LENGTH: dict[str, int] = {
    "llama2-7b-chat-4k": 3500, "longchat-v1.5-7b-32k": 31500, "xgen-7b-8k": 7500, "internlm-7b-8k": 7500,
    "chatglm2-6b": 31500, "chatglm2-6b-32k": 31500, "chatglm3-6b-32k": 31500, "vicuna-v1.5-7b-16k": 15500,
    "THUDM/chatglm2-6b": 31500, "THUDM/chatglm2-6b-32k": 31500, "THUDM/chatglm3-6b-32k": 31500,
}
ANSWER_ROOM = 500  # the budget of a model not in MODEL_MAX_LENGTH: its positions minus this

# tasks given to chat models without the chat format (pred.py: "chat models are better off without")
NO_CHAT = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# tasks scored on the first line of the prediction (eval.py): few-shot answers run on into a new example
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
CHINESE = frozenset({"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"})
# LongBench-E: the tasks with length-balanced test sets (files <task>_e.jsonl)
LONGBENCH_E: tuple[str, ...] = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
                                "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc",
                                "repobench-p")
# tasks that are not LongBench's own but follow one of its tasks' protocol (--data demo)
PROTOCOL_OF: dict[str, str] = {"demo_lcc": "lcc"}


def protocol(task: str) -> str:
    """The LongBench task whose template, generation length, chat rule and metric `task` uses."""
    name = PROTOCOL_OF.get(task, task)
    if name not in PROMPTS:
        raise ConfigError(f"LongBench task {task!r}: unknown; allowed: {', '.join(SUBSETS)}")
    return name


def metric_of(task: str) -> str:
    return METRIC[protocol(task)]


def category_of(task: str) -> str:
    return CATEGORY_OF.get(protocol(task), "code")


def resolve_tasks(spec: "str | Sequence[str]", e: bool = False, known: Sequence[str] | None = None) -> list[str]:
    """'all', 'en', 'zh', or comma-separated task and category names -> tasks in canonical order.

    known: the tasks the data offers (default LongBench v1's 21; with e, LongBench-E's 13)."""
    pool = list(known) if known is not None else list(LONGBENCH_E if e else SUBSETS)
    from ...options import split_items

    names = split_items("--tasks", spec, "all, en, zh, task names or category names")
    chosen: set[str] = set()
    for n in names:
        if n == "all":
            chosen.update(pool)
        elif n in ("en", "zh"):
            chosen.update(t for t in pool if (protocol(t) in CHINESE) == (n == "zh"))
        elif n in pool:
            chosen.add(n)
        elif any(category_of(t) == n for t in pool):
            chosen.update(t for t in pool if category_of(t) == n)
        else:
            extra = " (LongBench-E has only its 13 English tasks)" if e and n in SUBSETS else ""
            raise ConfigError(f"--tasks: unknown name {n!r}{extra}; allowed: all, en, zh, categories "
                              f"({', '.join(sorted({category_of(t) for t in pool}))}) or tasks ({', '.join(pool)})")
    tasks = [t for t in pool if t in chosen]
    if not tasks:
        raise ConfigError(f"--tasks {spec!r}: selects no task of this data ({', '.join(pool)})")
    return tasks


def default_max_length(model_name: str, model_config=None) -> int:
    """LongBench's budget for a known model, else the model's positions minus ANSWER_ROOM."""
    for key in (model_name, str(model_name).rstrip("/").rsplit("/", 1)[-1]):
        if key in MODEL_MAX_LENGTH:
            return MODEL_MAX_LENGTH[key]
    positions = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "seq_length", None)
    if not isinstance(positions, int) or positions <= ANSWER_ROOM:
        raise ConfigError(f"{model_name}: no LongBench prompt budget known and no max_position_embeddings in its "
                          "config; pass --max-length N")
    return positions - ANSWER_ROOM


def chat_format(tokenizer, prompt: str, model_name: str) -> str:
    """The chat wrapping of pred.py's build_chat: ChatGLM2's own round format (its tokenizer's
    build_prompt, or the same text for a ChatGLM2 model whose tokenizer lacks it), else the
    tokenizer's chat template with one user turn, else the prompt unchanged (a base model)."""
    if callable(getattr(tokenizer, "build_prompt", None)):
        return tokenizer.build_prompt(prompt)
    if "chatglm2" in str(model_name).lower():
        return f"[Round 1]\n\n问：{prompt}\n\n答："
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def prompt_ids(tokenizer, task: str, context: str, question: str, max_length: int, model_name: str) -> list[int]:
    """Token ids of one record's prompt, as pred.py builds them: the task's template filled in; when
    it has more than max_length tokens (special tokens included), the first and the last
    max_length // 2 tokens, each decoded with special tokens skipped, joined as text; the chat format
    unless the task is in NO_CHAT; tokenized again with special tokens (without them after a chat
    template, which writes its own)."""
    name = protocol(task)
    prompt = PROMPTS[name].format(context=context, input=question)
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) > max_length:
        half = int(max_length / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + \
            tokenizer.decode(ids[-half:], skip_special_tokens=True)
    special = True
    if name not in NO_CHAT:
        chat = chat_format(tokenizer, prompt, model_name)
        # a chat template writes the special tokens (BOS...) itself: adding them again would double them
        special = not (chat != prompt and _templated(tokenizer))
        prompt = chat
    return list(tokenizer(prompt, truncation=False, add_special_tokens=special)["input_ids"])


def _templated(tokenizer) -> bool:
    return not callable(getattr(tokenizer, "build_prompt", None)) and bool(getattr(tokenizer, "chat_template", None))


def stop_ids(tokenizer, task: str) -> tuple[list[int] | None, int]:
    """(eos ids for generate(), min new tokens): samsum also stops at a newline and makes at least one
    token (pred.py: the model otherwise repeats "\\nDialogue" without end); others: the model's own eos."""
    if protocol(task) != "samsum":
        return None, 0
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    return [i for i in (tokenizer.eos_token_id, newline) if i is not None], 1
