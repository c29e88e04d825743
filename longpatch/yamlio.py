"""The one YAML reader of configs (a config file, a saved directory's longpatch.yaml, --set and --grid values).

YAML aliases let a few hundred bytes stand for billions of values (`&a [x, x]`, `&b [*a, *a]`, ...): the
loader shares them, but anything that walks the result (a check, an error message's repr, json.dumps of
a config id) expands them. So the composed document is measured first, every alias counted as the copy it
stands for, and one too large is refused in one line before anything is built from it.
"""
from __future__ import annotations

import yaml

from .errors import ConfigError, shown

# A config is a few dozen YAML nodes (a calibrated one of a 128-layer model a few hundred): 10,000 is far
# past any real one and still instant to check, print and hash.
MAX_NODES = 10_000
# The scalars' text, aliases expanded (a path is at most 4096 characters): again far past a real config.
MAX_CHARS = 1_000_000


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key)} (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, where: str):
    """The YAML document `text` as Python values. where: what the error names ('config: FILE', '--set KEY').
    A document that expands past MAX_NODES nodes or MAX_CHARS characters of text, or that contains itself,
    is a ConfigError; malformed YAML is a yaml.YAMLError for the caller to word (it knows the line's file)."""
    loader = StrictLoader(text)
    try:
        try:
            node = loader.get_single_node()  # the node graph: aliases are shared nodes, nothing is expanded yet
        except RecursionError:  # tens of thousands of nested brackets: PyYAML's composer recurses
            raise ConfigError(f"{where}: nested too deeply; allowed: a config of ordinary depth") from None
        if node is None:
            return None
        nodes, chars = expanded_size(node, where)
        if nodes > MAX_NODES or chars > MAX_CHARS:
            what = f"{MAX_NODES} values" if nodes > MAX_NODES else f"{MAX_CHARS} characters of text"
            raise ConfigError(f"{where}: expands to more than {what} (YAML aliases counted as the copies they "
                              f"stand for); allowed: at most {MAX_NODES} values and {MAX_CHARS} characters "
                              "(a config is a few dozen values)")
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise ConfigError(f"{where}: nested too deeply; allowed: a config of ordinary depth") from None
    finally:
        loader.dispose()


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def expanded_size(root, where: str = "YAML") -> tuple[int, int]:
    """(nodes, scalar characters) of a composed YAML document with every alias expanded, computed once per
    distinct node (so in time linear in the text, however far the aliases expand); each count stops just
    past its limit, so a bomb's 10**100 never becomes a number to add up. An alias inside the node it
    names (a document that contains itself) is a ConfigError: it would expand forever."""
    sizes: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()  # the nodes whose subtree is being measured: meeting one again is a cycle
    stack = [(root, False)]  # an explicit stack: a deep document must not exhaust Python's recursion
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            nodes, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            for child in _children(node):
                n, c = sizes[id(child)]
                nodes, chars = nodes + n, chars + c
            sizes[key] = (min(nodes, MAX_NODES + 1), min(chars, MAX_CHARS + 1))
            continue
        if key in sizes:
            continue
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise ConfigError(f"{where}: line {child.start_mark.line + 1}: an alias inside the value it "
                                  "names (a value that contains itself); allowed: YAML without recursive aliases")
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]
