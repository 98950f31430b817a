"""The JSON schema of a user-declared tool (`data.tools: [path/to/file.py:function]`), in the
OpenAI function-calling form chat templates take as `tools=`, built from the function's
signature, type hints and docstring; and the check of a call's arguments against it.

The schema is read from the file's source (`ast`), never by importing it: the config check runs
in every role and the coordinator renders prompts with it, and neither should run user code
outside the reward role's sandbox (nor need the tool's own libraries). So the function must be a
top-level `def` of that file, and its hints are read by name (`str`, `typing.Optional`, `t.List`
alike). Standard library only: the reward role's sandbox workers check arguments with it.

    def search(query: str, limit: int = 5) -> str:
        '''Search the notes.

        Args:
            query: words to look for
            limit: most results
        '''

is {"type": "function", "function": {"name": "search", "description": "Search the notes.",
"parameters": {"type": "object", "properties": {"query": {"type": "string", "description":
"words to look for"}, "limit": {"type": "integer", "description": "most results", "default": 5}},
"required": ["query"]}}}.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

BUILTIN_TOOLS = ("calculator", "python")
_SCALARS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?|"
                      r"Attributes|See Also|Warnings?|Todo)\s*:\s*$")
_ARG_LINE = re.compile(r"^(?P<name>\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


class ToolSchemaError(ValueError):
    """The file or function cannot describe a tool; the message says why."""


def tool_schemas(entries: list[str], key: str = "data.tools") -> list[dict]:
    """The schemas of `data.tools`: built-in tools by name, user tools from their files. A problem is
    a ToolSchemaError naming the entry (`data.tools[1]: ...`)."""
    from rolefleet.reward.env_tools import TOOL_SCHEMAS  # both run in the sandbox: standard library only

    schemas: list[dict] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        try:
            if is_user_tool(entry):
                schema = user_tool_schema(entry)
            elif entry in TOOL_SCHEMAS:
                schema = TOOL_SCHEMAS[entry]
            else:
                raise ToolSchemaError(f"unknown tool {entry!r}; built-in tools: {', '.join(BUILTIN_TOOLS)}, or a "
                                      "function of your own: path/to/file.py:function")
        except ToolSchemaError as e:
            raise ToolSchemaError(f"{key}[{i}]: {e}") from None
        name = schema["function"]["name"]
        if name in seen:  # the model calls a tool by its name alone
            raise ToolSchemaError(f"{key}[{i}]: a second tool named {name!r} (the first is {key}[{seen[name]}])")
        seen[name] = i
        schemas.append(schema)
    return schemas


def is_user_tool(entry: str) -> bool:
    """A `data.tools` entry of the form path/to/file.py:function (else a built-in's name)."""
    return ":" in entry


def split_entry(entry: str) -> tuple[str, str]:
    """(file, function) of a user tool entry."""
    file, _, function = entry.rpartition(":")
    if not file or not function.isidentifier():
        raise ToolSchemaError(f"{entry!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor of the form "
                              "path/to/file.py:function")
    return file, function


def user_tool_schema(entry: str) -> dict:
    """The schema of the tool `entry` (path/to/file.py:function) names."""
    file, function = split_entry(entry)
    path = Path(file)
    if not path.is_file():
        raise ToolSchemaError(f"{file} is not a file")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ToolSchemaError(f"cannot read {file}: {e}") from None
    return schema_from_source(source, function, file)


def schema_from_source(source: str, function: str, where: str = "<source>") -> dict:
    """The schema of the top-level function `function` of the Python `source` (`where` names it)."""
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as e:
        raise ToolSchemaError(f"{where} is not valid Python: {e.msg} (line {e.lineno})") from None
    node = _find(tree, function, where)
    args = node.args
    if args.vararg or args.kwarg:
        star = f"*{args.vararg.arg}" if args.vararg else f"**{args.kwarg.arg}"
        raise ToolSchemaError(f"{where}:{function} takes {star}: a tool's parameters are named, one by one")
    if args.posonlyargs:
        raise ToolSchemaError(f"{where}:{function} has positional-only parameters: a tool is called with "
                              "keyword arguments")
    params = args.args + args.kwonlyargs
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults) + list(args.kw_defaults)
    described = _arg_descriptions(ast.get_docstring(node) or "")
    properties, required = {}, []
    for param, default in zip(params, defaults):
        if param.annotation is None:
            raise ToolSchemaError(f"{where}:{function}: parameter {param.arg!r} has no type hint (the schema "
                                  "tells the model each parameter's type)")
        try:
            prop = annotation_schema(param.annotation)
        except ToolSchemaError as e:
            raise ToolSchemaError(f"{where}:{function}: parameter {param.arg!r}: {e}") from None
        if param.arg in described:
            prop["description"] = described[param.arg]
        if default is None:
            required.append(param.arg)
        elif (value := _literal(default)) is not _NO_VALUE:
            prop["default"] = value
        properties[param.arg] = prop
    return {"type": "function", "function": {
        "name": function, "description": _summary(ast.get_docstring(node) or ""),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def _find(tree: ast.Module, function: str, where: str) -> ast.FunctionDef:
    """The last top-level binding of `function` (the one Python keeps), which must be a def."""
    found: ast.AST | None = None
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == function:
            found = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == function for t in targets):
                found = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == function for a in stmt.names):
                found = stmt
    if found is None:
        raise ToolSchemaError(f"{where} defines no function {function!r} (at its top level)")
    if isinstance(found, ast.FunctionDef):
        return found
    if isinstance(found, ast.AsyncFunctionDef):
        raise ToolSchemaError(f"{where}:{function} is async: a tool is a plain function (def)")
    if isinstance(found, (ast.Assign, ast.AnnAssign)) and isinstance(found.value, ast.Lambda):
        raise ToolSchemaError(f"{where}:{function} is a lambda: declare the tool with def, its parameters "
                              "typed (the schema is read from them)")
    what = {ast.ClassDef: "a class", ast.Import: "an import", ast.ImportFrom: "an import"}.get(type(found),
                                                                                                "a value")
    raise ToolSchemaError(f"{where}:{function} is {what}, not a function: declare the tool with def in this file")


def annotation_schema(node: ast.expr) -> dict:
    """The JSON schema of a type hint: str, int, float, bool, list[X], dict[str, X], Optional[X]
    (X | None; nullable), Literal[...] of strings or of ints."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted hint
        try:
            return annotation_schema(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            raise ToolSchemaError(f"unsupported type {node.value!r}") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        return _union([node.left, node.right], ast.unparse(node))
    name = _name(node.value if isinstance(node, ast.Subscript) else node)
    if not isinstance(node, ast.Subscript):
        if name in _SCALARS:
            return {"type": _SCALARS[name]}
        if name in ("list", "List"):
            return {"type": "array"}
        if name in ("dict", "Dict"):
            return {"type": "object"}
        raise ToolSchemaError(f"unsupported type {ast.unparse(node)}; {_SUPPORTED}")
    items = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    if name in ("list", "List") and len(items) == 1:
        return {"type": "array", "items": annotation_schema(items[0])}
    if name in ("dict", "Dict") and len(items) == 2 and _name(items[0]) == "str":
        return {"type": "object", "additionalProperties": annotation_schema(items[1])}
    if name == "Optional" and len(items) == 1:
        return {**annotation_schema(items[0]), "nullable": True}
    if name == "Union":
        return _union(items, ast.unparse(node))
    if name == "Literal":
        values = [_literal(v) for v in items]
        kinds = {type(v) for v in values}
        if kinds == {str} or kinds == {int}:
            return {"type": "string" if kinds == {str} else "integer", "enum": values}
        raise ToolSchemaError(f"unsupported type {ast.unparse(node)}: a Literal of strings, or of ints")
    raise ToolSchemaError(f"unsupported type {ast.unparse(node)}; {_SUPPORTED}")


_SUPPORTED = "supported: str, int, float, bool, list[...], dict[str, ...], Optional[...], Literal[...]"


def _union(members: list[ast.expr], text: str) -> dict:
    others = [m for m in members if not (isinstance(m, ast.Constant) and m.value is None) and _name(m) != "None"]
    if len(others) != 1 or len(members) != 2:
        raise ToolSchemaError(f"unsupported type {text}: a union is X | None (Optional[X]) only")
    return {**annotation_schema(others[0]), "nullable": True}


def _name(node: ast.expr) -> str:
    """`str` of `str`, `typing.Optional` or `t.Optional`: hints are matched by their last name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


_NO_VALUE = object()


def _literal(node: ast.expr) -> Any:
    """A default's value when it is a JSON literal (a default that is not is left out of the schema)."""
    try:
        return json.loads(json.dumps(ast.literal_eval(node), allow_nan=False))  # a tuple is a JSON array
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return _NO_VALUE


def _summary(doc: str) -> str:
    """The docstring's first paragraph, on one line."""
    paragraph = []
    for line in doc.strip().splitlines():
        if not line.strip() or _SECTION.match(line):
            break
        paragraph.append(line.strip())
    return " ".join(paragraph)


def _arg_descriptions(doc: str) -> dict[str, str]:
    """Parameter descriptions of a Google-style `Args:` section: `name: text` or `name (type):
    text`, continued on lines indented deeper than the name's."""
    out: dict[str, str] = {}
    lines, i = doc.splitlines(), 0
    while i < len(lines) and not re.match(r"^\s*(Args|Arguments|Parameters)\s*:\s*$", lines[i]):
        i += 1
    indent, current = None, None
    for line in lines[i + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or (depth == indent and _SECTION.match(line)):
            break
        match = _ARG_LINE.match(line.strip()) if depth == indent else None
        if match:
            current = match["name"].lstrip("*")
            out[current] = match["text"].strip()
        elif current is not None:
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def check_arguments(schema: dict, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's schema (unknown or missing ones, a wrong type), or None."""
    params = schema["function"]["parameters"]
    properties = params["properties"]
    if unknown := sorted(k for k in arguments if k not in properties):
        return f"unknown argument(s) {', '.join(unknown)}; takes {', '.join(properties) or 'none'}"
    if missing := [k for k in params["required"] if k not in arguments]:
        return f"missing argument(s) {', '.join(missing)}"
    for key, value in arguments.items():
        if (problem := _mismatch(properties[key], value)) is not None:
            return f"argument {key!r}: {problem}"
    return None


_PYTHON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
                 "object": dict}


def _mismatch(schema: dict, value: Any) -> str | None:
    if value is None:
        return None if schema.get("nullable") else "must not be null"
    expected = schema["type"]
    if not isinstance(value, _PYTHON_TYPES[expected]) or (isinstance(value, bool) and expected != "boolean"):
        return f"expected {'an' if expected[0] in 'aeio' else 'a'} {expected}, got {json.dumps(value)[:80]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"expected one of {', '.join(json.dumps(v) for v in schema['enum'])}, got {json.dumps(value)[:80]}"
    if expected == "array" and "items" in schema:
        for n, item in enumerate(value):
            if (problem := _mismatch(schema["items"], item)) is not None:
                return f"item {n}: {problem}"
    if expected == "object" and "additionalProperties" in schema:
        for k, item in value.items():
            if (problem := _mismatch(schema["additionalProperties"], item)) is not None:
                return f"key {k!r}: {problem}"
    return None
