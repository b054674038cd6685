"""Reading what a verl user has: a launch command (`python3 -m verl.trainer.main_ppo k=v ...`,
as a shell script, a pasted line or argv) or a verl YAML config, into one flat, ordered
`{dotted.key: value}` dict with hydra's value types. `grpo_api.from_verl` maps that dict.

Shell: a script is run by bash itself (`grpo_api.verl_shell`: launchers stubbed, in temporary
folders), so the arguments are the ones bash passes. Text that bash launches nothing from and that
has no shell logic (a command flattened onto one line by a web page, with `\\ ` between its
arguments; pasted `key=value` lines) is read by the small static reader below: quotes, `\\`
continuations, comments, `$VAR`, `${VAR:-default}`, `$((arithmetic))`; the environment (`$HOME`)
is consulted only with `expand_env` and is otherwise left as written.

Hydra: `+key=v` / `++key=v` additions, `~key` deletions, values typed as hydra types them
(true/false, null, ints, floats like 1e-6, quoted strings, `[a,b]` lists, `{k: v}` dicts), and
`${path}` / `${oc.select:path,default}` / `${oc.env:VAR}` interpolations.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_api import verl_shell

# `python -m MODULE` entry points whose overrides are verl config keys: verl's and its recipes'
# trainers (`from_verl` refuses those it doesn't implement, by name).
_ENTRY_MODULE = re.compile(r"^(verl|recipe)\.[\w.]*(main|trainer)\w*$")
_ENTRY_SCRIPT = re.compile(r"(^|/)(main_ppo|main_dapo|main_\w+)\.py$")
# Shell logic: text holding any is never read statically (a branch bash skips would be applied).
_SHELL_LOGIC = re.compile(r"(^|[;&|(]|\n)\s*(if|case|for|while|until|select|function|source|\.)\s|\w\s*\(\)\s*\{|&&|\|\|")
_OVERRIDE = re.compile(r"^(\+{0,2}|~)([A-Za-z_][\w-]*(\.[\w-]+)+)(=(.*))?$", re.S)
_NAME = re.compile(r"[A-Za-z_]\w*")
VERL_SECTIONS = ("actor_rollout_ref", "algorithm", "critic", "custom_reward_function", "data",
                 "reward_model", "reward_manager", "trainer", "ray_kwargs", "global_profiler", "ray_init",
                 "transfer_queue")


class VerlInputError(ValueError):
    """Input that holds no verl configuration at all."""


@dataclass
class VerlConfig:
    """The verl settings found in the input, in their order; `+` additions and `~` deletions
    keep their hydra prefix out of the key and are listed in `added` / `deleted`."""

    flat: dict[str, Any] = field(default_factory=dict)
    added: set[str] = field(default_factory=set)
    deleted: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    entry: str | None = None          # e.g. "verl.trainer.main_ppo"
    hydra_options: list[str] = field(default_factory=list)


# --- shell ------------------------------------------------------------------------------------

@dataclass
class _Part:
    kind: str          # lit | var | arith | cmd | array
    text: str          # literal text, or the expansion's inside (NAME, NAME:-x, a * b, cmd)
    quoted: bool
    raw: str = ""      # the expansion as written, kept when it is left unexpanded
    items: list = field(default_factory=list)   # array: the elements' words (`NAME=(a b)`)


class _Lexer:
    """Splits shell text into commands of words; each word a list of parts, expansions unexpanded."""

    def __init__(self, text: str):
        self.s, self.i = text.replace("\r\n", "\n"), 0
        self.commands: list[list[list[_Part]]] = []
        self.words: list[list[_Part]] = []
        self.parts: list[_Part] = []
        self.buf, self.buf_quoted = "", False

    def _flush_lit(self) -> None:
        if self.buf:
            self.parts.append(_Part("lit", self.buf, self.buf_quoted))
        self.buf = ""

    def _lit(self, text: str, quoted: bool) -> None:
        if quoted != self.buf_quoted:
            self._flush_lit()
            self.buf_quoted = quoted
        self.buf += text

    def _end_word(self) -> None:
        self._flush_lit()
        if self.parts:
            self.words.append(self.parts)
        self.parts = []

    def _end_command(self) -> None:
        self._end_word()
        if self.words:
            self.commands.append(self.words)
        self.words = []

    def _quoted_empty(self, empty: bool) -> None:
        """'' or "": an empty word that still counts as a word."""
        if empty:
            self._flush_lit()
            self.parts.append(_Part("lit", "", True))

    def _word_empty(self) -> bool:
        return not self.parts and not self.buf

    def _matching(self, start: int, open_: str, close: str) -> int:
        """Index just past the `close` that balances the `open_` before `start` (quotes respected)."""
        depth, i = 1, start
        while i < len(self.s):
            c = self.s[i]
            if c == "\\":
                i += 2
                continue
            if c == "'" and open_ != "{":
                i = self.s.find("'", i + 1) + 1 or len(self.s)
                continue
            if self.s.startswith(open_, i):
                depth += 1
                i += len(open_)
                continue
            if self.s.startswith(close, i):
                depth -= 1
                i += len(close)
                if depth == 0:
                    return i
                continue
            i += 1
        raise VerlInputError(f"unbalanced {open_!r} in the shell input")

    def _dollar(self, quoted: bool) -> None:
        s, i = self.s, self.i
        if s.startswith("$((", i):
            end = self._matching(i + 3, "((", "))")
            self._flush_lit()
            self.parts.append(_Part("arith", s[i + 3:end - 2], quoted, s[i:end]))
        elif s.startswith("$(", i):
            end = self._matching(i + 2, "(", ")")
            self._flush_lit()
            self.parts.append(_Part("cmd", s[i + 2:end - 1], quoted, s[i:end]))
        elif s.startswith("${", i):
            end = self._matching(i + 2, "{", "}")
            self._flush_lit()
            self.parts.append(_Part("var", s[i + 2:end - 1], quoted, s[i:end]))
        elif (m := _NAME.match(s, i + 1)) or (i + 1 < len(s) and s[i + 1] in "@*#?$!0123456789"):
            end = m.end() if m else i + 2
            self._flush_lit()
            self.parts.append(_Part("var", s[i + 1:end], quoted, s[i:end]))
        else:
            self._lit("$", quoted)
            end = i + 1
        self.i = end

    def _backtick(self, quoted: bool) -> None:
        end = self.s.find("`", self.i + 1) + 1
        if not end:
            raise VerlInputError("unterminated ` in the shell input")
        self._flush_lit()
        self.parts.append(_Part("cmd", self.s[self.i + 1:end - 1], quoted, self.s[self.i:end]))
        self.i = end

    def _double_quoted(self) -> None:
        s = self.s
        self.i += 1
        while self.i < len(s) and s[self.i] != '"':
            c = s[self.i]
            if c == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    self._lit(s[self.i + 1], True)
                self.i += 2
            elif c == "$":
                self._dollar(True)
            elif c == "`":
                self._backtick(True)
            else:
                self._lit(c, True)
                self.i += 1
        if self.i >= len(s):
            raise VerlInputError("unterminated double quote in the shell input")
        self.i += 1

    def _redirect(self) -> None:
        """Drop a redirection (`2>&1`, `> log`, `&> log`) and its target word."""
        if self.buf.isdigit() and not self.parts:
            self.buf = ""
        self._end_word()
        s = self.s
        while self.i < len(s) and s[self.i] in "<>&":
            self.i += 1
        if s[self.i - 1] == "&" and self.i < len(s) and s[self.i].isdigit():
            self.i += 1
            return
        while self.i < len(s) and s[self.i] in " \t":
            self.i += 1
        saved = (self.words, self.parts)
        self.words, self.parts = [], []
        while self.i < len(s) and s[self.i] not in " \t\n;|&<>":
            self._step()
        self._flush_lit()
        self.words, self.parts = saved

    def _step(self) -> None:
        s, c = self.s, self.s[self.i]
        nxt = s[self.i + 1] if self.i + 1 < len(s) else ""
        if c == "\\":
            if nxt == "\n" or (nxt in " \t" and self._word_empty()):
                self.i += 2          # a continuation, or the `\ ` a flattened paste leaves
                return
            self._lit(nxt, True)
            self.i += 2
        elif c == "'":
            end = s.find("'", self.i + 1)
            if end < 0:
                raise VerlInputError("unterminated single quote in the shell input")
            self._quoted_empty(end == self.i + 1)
            self._lit(s[self.i + 1:end], True)
            self.i = end + 1
        elif c == '"':
            self._quoted_empty(nxt == '"')
            self._double_quoted()
        elif c == "$":
            self._dollar(False)
        elif c == "`":
            self._backtick(False)
        else:
            self._lit(c, False)
            self.i += 1

    def run(self) -> list[list[list[_Part]]]:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\r":
                self._end_word()
                self.i += 1
            elif c == "(" and not self.parts and re.fullmatch(r"[A-Za-z_]\w*=", self.buf):
                end = self._matching(self.i + 1, "(", ")")          # NAME=( a b ... ): an array
                items = [w for cmd in _Lexer(self.s[self.i + 1:end - 1]).run() for w in cmd]
                self._flush_lit()
                self.parts.append(_Part("array", "", False, self.s[self.i:end], items))
                self.i = end
            elif c == "\n" or c in ";|&()":
                if c == "&" and self.i + 1 < len(s) and s[self.i + 1] == ">":
                    self._redirect()
                    continue
                self._end_command()
                self.i += 1
            elif c in "<>":
                self._redirect()
            elif c == "#" and self._word_empty():
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            else:
                self._step()
        self._end_command()
        return self.commands


_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.Div: lambda a, b: int(a / b), ast.FloorDiv: lambda a, b: int(a / b),
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(expr: str, lookup) -> int:
    """bash `$(( ))`: integers, + - * / % ** and parentheses; names are variables."""
    def value(m: re.Match) -> str:
        v = lookup(m.group(1))
        if v is None or not re.fullmatch(r"\s*-?\d+\s*", v):
            raise ValueError(m.group(1))
        return f"({int(v)})"
    text = re.sub(r"\$?\{?([A-Za-z_]\w*)\}?", value, expr)

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](ev(node.operand))
        raise ValueError(expr)
    return ev(ast.parse(text.strip(), mode="eval"))


class _Expander:
    def __init__(self, expand_env: bool):
        self.vars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.expand_env = expand_env
        self.left: list[str] = []          # references left as written

    def lookup(self, name: str) -> str | None:
        if name.isdigit():
            return None                   # the script's arguments: none here
        if name in self.vars:
            return self.vars[name]
        if self.expand_env and name in os.environ:
            return os.environ[name]
        return None

    def _keep(self, part: _Part) -> str:
        """A placeholder for an expansion left as written: it must not look like a hydra
        interpolation meanwhile (`${HOME}`); `restore` puts the text back."""
        if part.raw not in self.left:
            self.left.append(part.raw)
        return f"\0{self.left.index(part.raw)}\0"

    def restore(self, cfg: VerlConfig) -> None:
        used: set[str] = set()

        def back(value: Any) -> Any:
            if isinstance(value, str) and "\0" in value:
                def sub(m: re.Match) -> str:
                    used.add(self.left[int(m.group(1))])
                    return self.left[int(m.group(1))]
                return re.sub(r"\0(\d+)\0", sub, value)
            if isinstance(value, list):
                return [back(v) for v in value]
            if isinstance(value, dict):
                return {k: back(v) for k, v in value.items()}
            return value
        cfg.flat = {k: back(v) for k, v in cfg.flat.items()}
        for ref in self.left:
            if ref in used and ref.startswith("$(("):
                cfg.warnings.append(f"{ref}: arithmetic on values this translator doesn't know; left as written")
            elif ref in used and ref.startswith(("$(", "`")):
                cfg.warnings.append(f"{ref}: command substitution is not run; left as written")
            elif ref in used:
                cfg.warnings.append(f"{ref} is left as written; pass --expand-env to take it from the environment")

    def _var(self, part: _Part) -> str:
        inner = part.text
        if inner in ("@", "*", "#", "?", "!", "$") or inner.isdigit():
            return ""                     # a script's own arguments: none here
        m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(?:(:?[-=+])(.*)|(,,|\^\^))?", inner, re.S)
        if not m:
            return self._keep(part)
        name, op, arg, case = m.groups()
        value = self.lookup(name)
        if op and op.endswith("+"):
            return self.expand_text(arg) if value else ""
        if op and (value is None or (op.startswith(":") and value == "")):
            value = self.expand_text(arg)
            if op.endswith("="):
                self.vars[name] = value
        if value is None:
            return self._keep(part)
        return value.lower() if case == ",," else value.upper() if case == "^^" else value

    def expand_text(self, text: str) -> str:
        """A `${VAR:-default}` default: its own quotes and expansions, words joined."""
        words = [w for cmd in _Lexer(text).run() for w in cmd]
        return " ".join(filter(None, (self.word(w) for w in words)))

    def words(self, parts: list[_Part]) -> list[str]:
        """A word's expansion: none, one, or an array's elements (`"${CONFIG[@]}"`)."""
        m = re.fullmatch(r"([A-Za-z_]\w*)\[[@*]\]", parts[0].text) if len(parts) == 1 else None
        if m and parts[0].kind == "var":
            return list(self.arrays.get(m.group(1), []))
        word = self.word(parts)
        return [] if word is None else [word]

    def word(self, parts: list[_Part]) -> str | None:
        """The word's text; None when it expands to nothing (an unquoted empty expansion)."""
        out, vanished = [], True
        for p in parts:
            if p.kind == "lit":
                out.append(p.text)
                vanished = False
            elif p.kind == "var":
                text = self._var(p)
                vanished = vanished and not text and not p.quoted
                out.append(text)
            elif p.kind == "arith":
                try:
                    out.append(str(_arith(p.text, self.lookup)))
                except (ValueError, SyntaxError, ZeroDivisionError, TypeError):
                    out.append(self._keep(p))
                vanished = False
            else:
                out.append(self._keep(p))
                vanished = False
        return None if vanished else "".join(out)

    def assignment(self, parts: list[_Part]) -> tuple[str, str] | None:
        first = parts[0]
        m = re.match(r"([A-Za-z_]\w*)=", first.text) if first.kind == "lit" and not first.quoted else None
        if not m:
            return None
        if len(parts) == 2 and parts[1].kind == "array" and first.text == m.group(0):
            self.arrays[m.group(1)] = [w for item in parts[1].items for w in self.words(item)]
            return m.group(1), ""
        rest = [_Part("lit", first.text[m.end():], False), *parts[1:]]
        return m.group(1), self.word(rest) or ""


def read_input(path: str | None, *, args: list[str] | None = None, expand_env: bool = False,
               env: dict[str, str] | None = None) -> tuple[VerlConfig, str]:
    """What `grpo from-verl` reads, and a name for it: a file or stdin (`-` or None) holding a
    script or a YAML config, and/or arguments (a script's arguments, its `$@`). `env`: variables
    set for the script's run (`--env DEVICE=npu`)."""
    if args is not None and not path:
        return read_command(argv=args, expand_env=expand_env), "arguments"
    if path in (None, "-"):
        text, source = sys.stdin.read(), "stdin"
    else:
        try:
            text, source = Path(path).read_text(encoding="utf-8"), path
        except (OSError, UnicodeDecodeError) as exc:
            raise VerlInputError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    doc = looks_like_verl_yaml(text)
    if doc is None:
        script = None if path in (None, "-") else path
        return read_script(text, path=script, extra=args or [], expand_env=expand_env, env=env), source
    if args:
        raise VerlInputError("arguments after -- extend a command, not a YAML config")
    return read_yaml(doc, expand_env=expand_env), source


def _find_entry(words: list[str]) -> int | None:
    """Index of the first override after `-m verl.trainer.main_ppo` (or `.../main_ppo.py`)."""
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words) and _ENTRY_MODULE.match(words[i + 1]):
            return i + 2
        if _ENTRY_SCRIPT.search(w) and "=" not in w:
            return i + 1
    return None


def read_script(text: str, *, path: str | None = None, extra: list[str] = (), expand_env: bool = False,
                env: dict[str, str] | None = None) -> VerlConfig:
    """A launch script as bash runs it: the arguments of its one verl launch. `extra` are the
    script's arguments (`bash run.sh k=v`); overrides among them that the script doesn't forward
    (no `$@`) are appended to the launch, with a warning."""
    try:
        run = verl_shell.run_script(text, path=path, args=list(extra), env=env, expand_env=expand_env)
    except verl_shell.ShellError as exc:
        raise VerlInputError(str(exc)) from None
    launches = [(argv, start) for argv in run.launches if (start := _find_entry(argv)) is not None]
    if not launches and not _SHELL_LOGIC.search(text):
        return read_command(text, extra=extra, expand_env=expand_env)     # a paste: no shell logic to follow
    setting = f" with {', '.join(f'{k}={v}' for k, v in env.items())}" if env else ""
    if len(launches) > 1:
        raise VerlInputError(f"the script launches {len(launches)} verl entry points{setting}: "
                             + "; ".join(verl_shell.describe(a) for a, _ in launches) + "; translate one at a time")
    if not launches:
        said = run.stderr.strip().splitlines()[-3:]
        raise VerlInputError(f"the script launches no verl entry point (python3 -m verl.trainer.main_ppo ...) as bash "
                             f"runs it{setting} (bash exit code {run.code}"
                             + (f"; its last words: {' | '.join(said)}" if said else "") + ")")
    argv, start = launches[0]
    cfg = VerlConfig(entry=argv[start - 1], warnings=list(run.warnings))
    # What else the script runs is not run here: data preparation, probes. (verl's DEVICE probe,
    # `python3 -c 'import torch_npu'`, answers "gpu" as on an NVIDIA machine: nothing to say.)
    cfg.warnings += [f"not run here: {verl_shell.describe(a)} (the script sees no output from it)"
                     for a in run.launches if _find_entry(a) is None and "import torch_npu" not in a]
    overrides = argv[start:]
    dropped = [w for w in extra if _OVERRIDE.match(w) and w not in overrides]
    if dropped:
        cfg.warnings.append(f"the script doesn't pass its arguments on (no \"$@\"); its {len(dropped)} key=value "
                            f"argument(s) appended to its launch")
    for word in [*overrides, *dropped]:
        _add_override(cfg, word)
    _resolve_interpolations(cfg, expand_env)
    return cfg


def read_command(text: str | None = None, *, argv: list[str] | None = None, extra: list[str] = (),
                 expand_env: bool = False) -> VerlConfig:
    """A verl launch: shell `text` (a script, or a pasted line), or `argv` already split by a
    shell. `extra` overrides come last, as a script's `$@` passes them (`bash run.sh k=v`)."""
    cfg = VerlConfig()
    exp = _Expander(expand_env)
    if argv is not None:
        commands = [list(argv)]
    else:
        commands = []
        for words in _Lexer(text).run():
            first = words[0][0]
            if len(words[0]) == 1 and first.kind == "lit" and first.text in ("export", "declare", "local", "readonly"):
                words = [w for w in words[1:] if not (w[0].kind == "lit" and w[0].text.startswith("-"))]
            assigns = [exp.assignment(w) for w in words]
            if words and all(assigns):
                exp.vars.update((k, v) for k, v in assigns if k not in exp.arrays)
                continue
            expanded = [w for p in words for w in exp.words(p)]
            if expanded:
                commands.append(expanded)
    overrides: list[str] = []
    for words in commands:
        start = _find_entry(words)
        if start is None:
            continue
        if cfg.entry is not None:
            cfg.warnings.append(f"more than one verl launch in the input; used the first ({cfg.entry})")
            break
        cfg.entry = words[start - 1]
        overrides = words[start:]
    if cfg.entry is None:
        # No `python -m verl...`: the overrides alone (pasted lines of key=value, or argv).
        overrides = [w for words in commands for w in words if (m := _OVERRIDE.match(w)) and m.group(4)]
    overrides = [*overrides, *extra]
    if not overrides:
        raise VerlInputError("no verl launch command (python3 -m verl.trainer.main_ppo key=value ...) "
                             "and no verl key=value overrides in the input")
    for word in overrides:
        _add_override(cfg, word)
    _resolve_interpolations(cfg, expand_env)
    exp.restore(cfg)
    return cfg


def _add_override(cfg: VerlConfig, word: str) -> None:
    m = _OVERRIDE.match(word)
    if not m:
        if word.startswith("-"):
            cfg.hydra_options.append(word)
        else:
            cfg.warnings.append(f"argument {word!r} is not a key=value override; ignored")
        return
    prefix, key, _, has_value, raw = m.groups()
    if prefix == "~":
        cfg.deleted.append(key)
        return
    if has_value is None:
        cfg.warnings.append(f"argument {word!r} has no '='; ignored")
        return
    if prefix:
        cfg.added.add(key)
    cfg.flat.pop(key, None)               # a repeated key: the last one wins, at its place
    cfg.flat[key] = parse_hydra_value(raw)


# --- hydra values -----------------------------------------------------------------------------

_INT = re.compile(r"[+-]?\d[\d_]*")
_FLOAT = re.compile(r"[+-]?(\d[\d_]*\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)", re.I)


def _split_top(text: str, sep: str) -> list[str]:
    items, depth, quote, cur = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == sep and depth == 0:
            items.append(cur)
            cur = ""
            continue
        cur += c
    if cur.strip() or items:
        items.append(cur)
    return items


def parse_hydra_value(raw: str) -> Any:
    """A hydra override value as hydra types it."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].replace("\\" + text[0], text[0])
    if text.startswith("[") and text.endswith("]"):
        return [parse_hydra_value(x) for x in _split_top(text[1:-1], ",")]
    if text.startswith("{") and text.endswith("}") and not text.startswith("${"):
        out = {}
        for item in _split_top(text[1:-1], ","):
            k, _, v = item.partition(":")
            out[str(parse_hydra_value(k))] = parse_hydra_value(v)
        return out
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    if _INT.fullmatch(text):
        return int(text.replace("_", ""))
    if _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


# --- YAML configs and interpolations -----------------------------------------------------------

def looks_like_verl_yaml(text: str) -> dict | None:
    """The parsed document when `text` is a verl YAML config (a mapping with verl's sections)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    if isinstance(doc, dict) and any(k in doc for k in VERL_SECTIONS):
        return doc
    return None


def read_yaml(doc: dict, *, expand_env: bool = False) -> VerlConfig:
    """A verl config as ppo_trainer.yaml nests it (a full dump or a partial recipe config)."""
    cfg = VerlConfig(entry="yaml")

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            k = str(k)
            if k == "_target_":
                continue                  # verl's dataclass bindings, not settings
            if k == "defaults" and not prefix:
                names = [d if isinstance(d, str) else next(iter(d.values()), "") for d in v or []]
                cfg.hydra_options += [f"--config-name={n}" for n in names if isinstance(n, str) and n != "_self_"]
                continue
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            elif v != "???":              # hydra's "mandatory, not set"
                cfg.flat[key] = v
    walk(doc, "")
    _resolve_interpolations(cfg, expand_env)
    return cfg


_INTERP = re.compile(r"\$\{([^${}]*)\}")


def _resolve_interpolations(cfg: VerlConfig, expand_env: bool) -> None:
    """Resolve `${...}` in string values against the config itself; a value that can't be
    resolved (it names a verl default this input doesn't hold) is dropped with a warning."""
    def resolve(key: str, text: str, depth: int = 0) -> Any:
        whole = _INTERP.fullmatch(text)
        def one(expr: str) -> Any:
            expr = expr.strip()
            if expr.startswith("oc.env:"):
                name, _, default = expr[7:].partition(",")
                if expand_env and name.strip() in os.environ:
                    return os.environ[name.strip()]
                if default:
                    return parse_hydra_value(default)
                raise KeyError(expr)
            select = expr.startswith("oc.select:")
            path, _, default = (expr[10:] if select else expr).partition(",")
            path = path.strip()
            if path.startswith("."):
                dots = len(path) - len(path.lstrip("."))
                base = key.split(".")[:-dots]
                path = ".".join(base + [path.lstrip(".")])
            if path in cfg.flat:
                value = cfg.flat[path]
                if isinstance(value, str) and "${" in value and depth < 10:
                    value = resolve(path, value, depth + 1)
                return value
            if select:
                return parse_hydra_value(default) if default.strip() else None
            raise KeyError(expr)
        if whole:
            return one(whole.group(1))
        return _INTERP.sub(lambda m: str(one(m.group(1))), text)

    for key, value in list(cfg.flat.items()):
        if isinstance(value, str) and "${" in value:
            try:
                cfg.flat[key] = resolve(key, value)
            except KeyError:
                del cfg.flat[key]
                cfg.warnings.append(f"{key}={value}: the interpolation names a setting this input doesn't "
                                    f"hold; dropped (verl would resolve it from its defaults)")
