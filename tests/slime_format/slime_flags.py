"""slime's flags as its parser source defines them, and the table of what slime-core does with each.

- ``extract``: every ``--flag`` that THUDM/slime's ``slime/utils/arguments.py`` and
  ``slime/backends/sglang_utils/arguments.py`` define (``parser.add_argument`` and ``reset_arg``), read with ``ast``
  from the source text (slime is not imported): type, action, nargs, choices, default, dest, file and line.
- ``render``: ``docs/slime-flags.md`` from those flags and ``slimecore.defaults.slime_compat.SLIME_FLAGS``.

Refresh the test data from a slime checkout (or the doc after changing the table)::

    python tests/slime_format/slime_flags.py extract SLIME_GIT_DIR COMMIT   # writes slime_flags_<commit>.json
    python tests/slime_format/slime_flags.py doc                            # writes docs/slime-flags.md

``tests/test_slime_flags.py`` fails on a flag of the data with no decided fate, so a newer slime's new flags show up.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DOC = ROOT / "docs" / "slime-flags.md"
SOURCES = ("slime/utils/arguments.py", "slime/backends/sglang_utils/arguments.py")


def data_file() -> Path:
    """The one ``slime_flags_<commit>.json`` kept as test data."""
    [path] = sorted(HERE.glob("slime_flags_*.json"))
    return path


def load() -> dict:
    return json.loads(data_file().read_text())


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)  # an expression (512 * 1024 ** 2): kept as its source text


def extract(source: str, path: str) -> list[dict]:
    """Each ``add_argument("--x", ...)`` / ``reset_arg(parser, "--x", ...)`` of ``source``, in line order."""
    tree = ast.parse(source)
    flags = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        option_strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("--")]
        if name not in ("add_argument", "reset_arg") or not option_strings:
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        flag = {"flag": option_strings[0], "file": path, "line": node.lineno, "megatron_reset": name == "reset_arg"}
        action = kw.get("action")
        flag["action"] = (None if action is None else action.value if isinstance(action, ast.Constant)
                          else ast.unparse(action).replace("argparse.", ""))
        flag["type"] = ast.unparse(kw["type"]) if "type" in kw else None
        for key in ("nargs", "choices", "default", "dest"):
            flag[key] = _literal(kw[key]) if key in kw else None
        flag["dest"] = flag["dest"] or option_strings[0][2:].replace("-", "_")
        helptext = kw.get("help")
        flag["help"] = " ".join(str(_literal(helptext)).split()) if helptext is not None else ""
        flags.append(flag)
    return sorted(flags, key=lambda f: f["line"])


def extract_commit(git_dir: str, commit: str) -> dict:
    full = subprocess.run(["git", "-C", git_dir, "rev-parse", commit], capture_output=True, text=True,
                          check=True).stdout.strip()
    flags: dict[str, dict] = {}
    for path in SOURCES:
        source = subprocess.run(["git", "-C", git_dir, "show", f"{full}:{path}"], capture_output=True, text=True,
                                check=True).stdout
        for flag in extract(source, path):
            first = flags.setdefault(flag["flag"], flag)
            if first is not flag:  # defined again (sglang_parse_args' pre-parser): one entry, both places
                first.setdefault("also", []).append(f"{path}:{flag['line']}")
    return {"repository": "THUDM/slime", "commit": full, "files": list(SOURCES), "flags": list(flags.values())}


# ---------------------------------------------------------------------------------------------
# docs/slime-flags.md
# ---------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(data: dict, table: dict) -> str:
    short = data["commit"][:7]
    counts: dict[str, int] = {}
    for flag in data["flags"]:
        counts[table[flag["flag"]].kind] = counts.get(table[flag["flag"]].kind, 0) + 1
    lines = [
        "# slime's flags in slime-core",
        "",
        f"Every flag that THUDM/slime at `{short}` defines in {' and '.join(f'`{f}`' for f in data['files'])} "
        f"({len(data['flags'])} flags: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + "), "
        "with what `slime-core train` does with it:",
        "",
        "- **same**: the same name and meaning (*plugin X*: an option of that plugin, active with `--plugin X` "
        "or selected by `--advantage-estimator`);",
        "- **mapped**: accepted and turned into slime-core's equivalent, as the row says;",
        "- **refused**: the run stops before Ray starts with one line naming the flag, why, and what to use "
        "instead. A value listed as accepted means what slime-core does anyway and is not refused.",
        "",
        "Generated by `python tests/slime_format/slime_flags.py doc` from the flags read out of slime's parser source "
        f"(`tests/slime_format/{data_file().name}`) and the table `SLIME_FLAGS` in "
        "`slimecore/defaults/slime_compat.py`; `tests/test_slime_flags.py` feeds every flag to slime-core's parser "
        "and fails on a flag with no fate, on one accepted and then ignored, and when this file is not current.",
        "",
        "| slime flag | slime (file:line) | fate | in slime-core |",
        "|---|---|---|---|",
    ]
    for flag in data["flags"]:
        fate = table[flag["flag"]]
        where = f"{flag['file'].rsplit('/', 2)[-2]}/{Path(flag['file']).name}:{flag['line']}"
        lines.append(f"| `{flag['flag']}` | {where} | {fate.kind} | {_cell(fate.describe())} |")
    return "\n".join(lines) + "\n"


def write_doc() -> Path:
    from slimecore.defaults.slime_compat import SLIME_FLAGS

    DOC.write_text(render(load(), SLIME_FLAGS))
    return DOC


if __name__ == "__main__":
    if sys.argv[1:2] == ["extract"]:
        git_dir, commit = sys.argv[2], sys.argv[3]
        data = extract_commit(git_dir, commit)
        out = HERE / f"slime_flags_{data['commit'][:7]}.json"
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {len(data['flags'])} flags of {data['commit']} to {out}")
    elif sys.argv[1:2] == ["doc"]:
        print(f"wrote {write_doc()}")
    else:
        sys.exit(__doc__)
