"""One symbol per quantity: docs/glossary.md's Symbols table, and the cost formulas that use it.

Two checks:
(a) the Symbols table lists no symbol twice (a cell may list several, "i_p, i_d", each counted);
(b) the cost-formula docstrings of modules 07, 12 and 13 (the module docstring and every function
    docstring of solutions/m07_payload.py, m12_tp_costs.py and m13_costs.py) write their formulas
    with listed symbols only.

What (b) can see. A docstring line is cut into tokens: words, numbers, operators (+ - * / = ^ · ×,
and x between two symbols, read as "times"), parentheses, anything else. A *symbol-like* token is
one letter (Latin or Greek), possibly primed (V') or subscripted (i_d, z_max, τ_F): a subscript of
at most three characters, or any listed symbol. A *formula* is a run of symbol-like tokens,
numbers, operators and parentheses that holds at least one operator and one symbol-like token:
"(d - 1) / (d t) b (2 L P + 3 V' M)" is one, and each of its symbol-like tokens must be listed.
Code in backticks and the specs' unreduced marks ({U_t}) are left out first: they are names, not
symbols.

What it cannot see. A symbol alone in prose ("a block of P values") is no formula and is not checked,
nor is a code name written without backticks that reads as a word (n_tokens). It checks that a
symbol is listed, not that it means here what the table says; and it reads these three files'
docstrings only, not the chapters (whose tables mix formulas, code and prose). The article "a" is
read as a word (unless the glossary lists it), so "a d x t mesh" holds the formula d x t; any other
one-letter word next to a formula would be read as a symbol.
"""
from __future__ import annotations

import ast
import re

from course import REPO

GLOSSARY = REPO / "docs" / "glossary.md"
COST_FILES = ["m07_payload.py", "m12_tp_costs.py", "m13_costs.py"]

OPERATORS = {"+", "-", "*", "/", "=", "^", "·", "×", "->"}
LETTER = r"[A-Za-zΑ-Ωα-ω]"
TOKEN = re.compile(rf"->|{LETTER}_[\w&]+|{LETTER}[\w']*|\d+(?:\.\d+)?|[-+*/=^·×()]|\S")


def symbol_table() -> list[tuple[str, str]]:
    """(symbol, quantity) for every symbol of the glossary's Symbols table, in order."""
    text = GLOSSARY.read_text()
    section = text.split("## Symbols", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("symbol", "---") or not line.startswith("|"):
            continue
        rows += [(symbol.strip(), cells[1]) for symbol in cells[0].split(",")]
    return rows


def symbols() -> set[str]:
    return {symbol for symbol, _ in symbol_table()}


ARTICLES = {"a"}  # one-letter English words, read as words unless the glossary lists them


def is_symbol_like(token: str, listed: set[str]) -> bool:
    if token in listed:
        return True
    if token in ARTICLES:
        return False
    match = re.fullmatch(rf"{LETTER}(?:'|_([\w&]+))?", token)
    return bool(match) and (match[1] is None or len(match[1]) <= 3)


def formula_symbols(line: str, listed: set[str]) -> list[str]:
    """The symbol-like tokens of every formula in one line of prose (see the module docstring)."""
    line = re.sub(r"`[^`]*`", " ; ", line)          # code is names, not symbols
    line = re.sub(r"\{U_[^}]*\}", " ; ", line)      # a spec's unreduced mark
    tokens = TOKEN.findall(line)
    found, run = [], []

    def close():
        if any(t in OPERATORS for t in run) and any(is_symbol_like(t, listed) for t in run):
            found.extend(t for t in run if is_symbol_like(t, listed) and t not in ("x",))
        run.clear()
    for i, token in enumerate(tokens):
        between_symbols = (token == "x" and 0 < i < len(tokens) - 1
                           and is_symbol_like(tokens[i - 1], listed) and is_symbol_like(tokens[i + 1], listed))
        if between_symbols:
            run.append("×")
        elif token in OPERATORS or token in "()" or re.fullmatch(r"\d+(?:\.\d+)?", token) or \
                is_symbol_like(token, listed):
            run.append(token)
        else:
            close()
    close()
    return found


def cost_docstrings() -> list[tuple[str, str]]:
    """(where, docstring) for the module and every function of the cost-formula files."""
    found = []
    for name in COST_FILES:
        tree = ast.parse((REPO / "solutions" / name).read_text())
        found.append((name, ast.get_docstring(tree) or ""))
        found += [(f"{name}:{node.name}", ast.get_docstring(node) or "") for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef)]
    return found


def test_no_symbol_is_listed_twice():
    table = symbol_table()
    assert len(table) > 30, f"the Symbols table of {GLOSSARY.name} was not found or is nearly empty: {table}"
    seen, twice = {}, []
    for symbol, quantity in table:
        if symbol in seen:
            twice.append(f"{symbol!r}: {seen[symbol]!r} and {quantity!r}")
        seen.setdefault(symbol, quantity)
    assert not twice, "symbols listed for two quantities in docs/glossary.md: " + "; ".join(twice)


def test_the_cost_formulas_use_listed_symbols_only():
    listed = symbols()
    unlisted = [f"{where}: {symbol!r} in {line.strip()!r}" for where, doc in cost_docstrings()
                for line in doc.splitlines() for symbol in formula_symbols(line, listed) if symbol not in listed]
    assert not unlisted, ("formulas in the cost docstrings with symbols docs/glossary.md does not list (add the "
                          "symbol there, or write the quantity's listed symbol):\n" + "\n".join(unlisted))


def test_the_check_sees_formulas_and_only_formulas():
    listed = {"d", "t", "b", "L", "P", "V'", "M", "N", "z_max", "n"}
    assert formula_symbols("(d - 1) / (d t) b (2 L P + 3 V' M)", listed) == ["d", "d", "t", "b", "L", "P", "V'", "M"]
    assert formula_symbols("sends 2 (n - 1) / n of its tensor", listed) == ["n", "n"]
    assert formula_symbols("N = q_h H", listed) == ["N", "q_h", "H"]       # unlisted ones are reported
    assert formula_symbols("a block of P values, d x t ranks", listed) == ["d", "t"]  # x: times
    assert formula_symbols("`x @ w.t()` and M {U_d,t} -> M/t/d", listed) == ["M", "t", "d"]  # code, {U} left out
    assert formula_symbols("the loss of n_tokens tokens (z_max, Z)", listed) == []  # no operator, no formula
