"""User-declared tools' schemas (`data.tools: [path/to/file.py:function]`): built from the source of
the function (signature, hints, Google-style docstring) without running it, refused with the
`data.tools[i]` entry named, and the calls' arguments checked against them."""

import re
import textwrap

import pytest

from rolefleet.common.config import ConfigError
from rolefleet.reward.tool_schema import ToolSchemaError, check_arguments, schema_from_source, tool_schemas

SEARCH = '''
from typing import Literal, Optional
import typing as t

def search(query: str, limit: int = 5, scale: float = 1.5, exact: bool = False, tags: list[str] = [],
           mode: Literal["fast", "deep"] = "fast", level: Literal[1, 2] = 1, after: Optional[str] = None,
           before: "int | None" = None, ids: t.List[int] = (), meta: dict[str, float] = {}, *, lang: str = "en"):
    """Search the notes
    for words.

    Longer text that is not the summary.

    Args:
        query (str): words to look for,
            over two lines
        limit: most results

    Returns:
        the hits
    """
'''


def schema(source: str, name: str = "f") -> dict:
    return schema_from_source(textwrap.dedent(source), name, "tools.py")


def test_the_schema_is_read_from_the_signature_hints_and_docstring():
    s = schema(SEARCH, "search")
    assert s["type"] == "function"
    fn = s["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes for words."
    props = fn["parameters"]["properties"]
    assert fn["parameters"]["type"] == "object" and fn["parameters"]["required"] == ["query"]
    assert props["query"] == {"type": "string", "description": "words to look for, over two lines"}
    assert props["limit"] == {"type": "integer", "description": "most results", "default": 5}
    assert props["scale"] == {"type": "number", "default": 1.5}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "default": []}
    assert props["mode"] == {"type": "string", "enum": ["fast", "deep"], "default": "fast"}
    assert props["level"] == {"type": "integer", "enum": [1, 2], "default": 1}
    assert props["after"] == {"type": "string", "nullable": True, "default": None}
    assert props["before"] == {"type": "integer", "nullable": True, "default": None}  # a quoted X | None
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}, "default": []}
    assert props["meta"] == {"type": "object", "additionalProperties": {"type": "number"}, "default": {}}
    assert props["lang"] == {"type": "string", "default": "en"}  # keyword-only parameters are parameters too


def test_a_parameter_is_required_exactly_when_it_has_no_default_and_optional_only_allows_null():
    s = schema("""
        from typing import Optional
        def f(a: Optional[int], b: int = 0, c: bool = True):
            pass
        """)
    assert s["function"]["parameters"]["required"] == ["a"]
    assert s["function"]["description"] == ""  # no docstring
    assert s["function"]["parameters"]["properties"]["a"] == {"type": "integer", "nullable": True}


def test_a_default_that_is_not_json_is_left_out_of_the_schema_but_still_makes_the_parameter_optional():
    s = schema("""
        import math
        def f(x: float = math.pi):
            '''Args:
                x: the number'''
        """)
    assert s["function"]["parameters"] == {"type": "object", "required": [],
                                           "properties": {"x": {"type": "number", "description": "the number"}}}


@pytest.mark.parametrize("source, message", [
    ("def g(x: int): pass", "defines no function 'f' (at its top level)"),
    ("def g():\n    def f(x: int): pass", "defines no function 'f'"),
    ("f = lambda x: x", "is a lambda: declare the tool with def"),
    ("f = 3", "is a value, not a function"),
    ("class f: pass", "is a class, not a function"),
    ("from helpers import f", "is an import, not a function: declare the tool with def in this file"),
    ("async def f(x: int): pass", "is async"),
    ("def f(x): pass", "parameter 'x' has no type hint"),
    ("def f(x: int, *rest: int): pass", "takes *rest: a tool's parameters are named"),
    ("def f(x: int, **more: int): pass", "takes **more"),
    ("def f(x: int, /): pass", "positional-only"),
    ("def f(x: set[int]): pass", "parameter 'x': unsupported type set[int]; supported: str, int, float"),
    ("def f(x: 'Path'): pass", "unsupported type Path"),
    ("def f(x: int | str): pass", "a union is X | None (Optional[X]) only"),
    ("def f(x: dict[int, str]): pass", "unsupported type dict[int, str]"),
    ("from typing import Literal\ndef f(x: Literal['a', 1]): pass", "a Literal of strings, or of ints"),
    ("def f(x: int:", "not valid Python"),
])
def test_a_function_that_cannot_describe_a_tool_is_refused_saying_why(source, message):
    with pytest.raises(ToolSchemaError, match=re.escape(message)):
        schema(source)


def test_the_last_top_level_binding_is_the_function_python_keeps():
    assert schema("def f(x: int): pass\ndef f(y: str): pass")["function"]["parameters"]["required"] == ["y"]
    with pytest.raises(ToolSchemaError, match="is a lambda"):
        schema("def f(x: int): pass\nf = lambda x: x")


def test_data_tools_mixes_builtins_and_user_functions_and_names_the_bad_entry(tmp_path):
    (tmp_path / "tools.py").write_text(SEARCH + "\ndef untyped(x):\n    pass\n")
    good = tool_schemas(["calculator", f"{tmp_path}/tools.py:search"])
    assert [s["function"]["name"] for s in good] == ["calculator", "search"]
    cases = {
        f"{tmp_path}/none.py:search": rf"data.tools\[1\]: {tmp_path}/none.py is not a file",
        f"{tmp_path}/tools.py:missing": r"data.tools\[1\]: .* defines no function 'missing'",
        f"{tmp_path}/tools.py:untyped": r"data.tools\[1\]: .*parameter 'x' has no type hint",
        "browser": r"data.tools\[1\]: unknown tool 'browser'; built-in tools: calculator, python, or a function",
        f"{tmp_path}/tools.py:": r"data.tools\[1\]: .* is not a built-in tool .* nor of the form path/to/file.py",
        "calculator": r"data.tools\[1\]: a second tool named 'calculator' \(the first is data.tools\[0\]\)",
    }
    for entry, message in cases.items():
        with pytest.raises(ToolSchemaError, match=message):
            tool_schemas(["calculator", entry])


def test_the_config_refuses_a_bad_tool_entry_naming_its_key(make_config, tmp_path):
    (tmp_path / "tools.py").write_text("def lookup(word: str) -> str:\n    return word\n\nbad = lambda: 1\n")
    cfg = make_config(f"data.tools=[calculator, {tmp_path}/tools.py:lookup]", "reward.env.name=tools")
    assert cfg.data.tools == ["calculator", f"{tmp_path}/tools.py:lookup"]
    # The tools environment runs the user tools the model is shown; the built-ins stay its options'.
    assert cfg.reward.env.user_tools == (f"{tmp_path}/tools.py:lookup",)
    with pytest.raises(ConfigError, match=r"data.tools\[0\]: .*tools.py:bad is a lambda"):
        make_config(f"data.tools=[{tmp_path}/tools.py:bad]")
    with pytest.raises(ConfigError, match=r"data.tools\[0\]: .*missing.py is not a file"):
        make_config(f"data.tools=[{tmp_path}/missing.py:lookup]")


def test_arguments_are_checked_against_the_schema():
    s = schema(SEARCH, "search")
    assert check_arguments(s, {"query": "x"}) is None
    assert check_arguments(s, {"query": "x", "limit": 3, "scale": 2, "tags": ["a"], "after": None,
                               "mode": "deep", "meta": {"a": 1.0}}) is None  # an int is a number
    cases = {
        "missing argument(s) query": {},
        "unknown argument(s) page, q; takes query, limit, scale, exact, tags, mode, level, after, before, ids, "
        "meta, lang": {"query": "x", "q": 1, "page": 2},
        "argument 'query': expected a string, got 3": {"query": 3},
        "argument 'limit': expected an integer, got 2.5": {"query": "x", "limit": 2.5},
        "argument 'limit': expected an integer, got true": {"query": "x", "limit": True},
        "argument 'exact': expected a boolean, got 1": {"query": "x", "exact": 1},
        'argument \'mode\': expected one of "fast", "deep", got "slow"': {"query": "x", "mode": "slow"},
        "argument 'tags': item 1: expected a string, got 2": {"query": "x", "tags": ["a", 2]},
        "argument 'meta': key 'a': expected a number, got \"b\"": {"query": "x", "meta": {"a": "b"}},
        "argument 'limit': must not be null": {"query": "x", "limit": None},
    }
    for message, arguments in cases.items():
        assert check_arguments(s, arguments) == message
