"""The tree's own rules: kernels sit at the bottom, files stay readable, code speaks of the code."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
KERNEL_FILES = sorted(KERNELS.rglob("*.py"))
MAX_KERNEL_LINES = 600
MAX_JIT_LINES = 120


def _rel(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or "", node.level


@pytest.mark.parametrize("path", KERNEL_FILES, ids=_rel)
def test_kernels_import_only_torch_triton_and_each_other(path):
    tree = ast.parse(path.read_text())
    allowed = {"torch", "triton"} | set(sys.stdlib_module_names)
    bad = [f"line {n}: {mod}" for n, mod, level in _imports(tree)
           if level == 0 and mod.split(".")[0] not in allowed]
    assert not bad, f"{_rel(path)} imports outside torch/triton/kernels: {bad}"


@pytest.mark.parametrize("path", KERNEL_FILES, ids=_rel)
def test_kernel_files_stay_readable(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_KERNEL_LINES, f"{_rel(path)}: {len(lines)} lines"
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_JIT_LINES, f"{_rel(path)}:{node.lineno} {node.name}: {n} lines"


def _kernel_names(tree: ast.AST) -> set[str]:
    """Names a file binds to ``k3lab.kernels`` or to something imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.startswith("k3lab.kernels")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("k3lab.kernels"):
                names |= {a.asname or a.name for a in node.names}
            elif node.module == "k3lab":
                names |= {a.asname or a.name for a in node.names if a.name == "kernels"}
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _kernel_patches(tree: ast.AST) -> list[str]:
    """``setattr`` / ``monkeypatch.setattr`` calls on a kernel module or on what it defines."""
    names, found = _kernel_names(tree), []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args
                and ast.unparse(node.func) in ("setattr", "monkeypatch.setattr")):
            continue
        target = node.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            hit = target.value.startswith("k3lab.kernels")
        else:
            hit = _root_name(target) in names or ast.unparse(target).startswith("k3lab.kernels")
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)[:60]}")
    return found


def test_no_module_level_switch_is_patched():
    """Tests and benchmarks choose kernel behaviour through config objects, not by setting
    attributes of kernel modules (``k3lab.kernels``, whatever name they are imported under)."""
    offenders = [f"{_rel(path)}:{hit}"
                 for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
                 for hit in _kernel_patches(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_patch_check_finds_a_kernel_module_under_any_name():
    src = ("import k3lab.kernels.attn_res as ar\nfrom k3lab.kernels import moe\n"
           "import k3lab.kernels\nfrom k3lab import kernelenv, runner\n"
           "monkeypatch.setattr(ar, 'X', 1)\nsetattr(moe.stages, 'Y', 2)\n"
           "monkeypatch.setattr('k3lab.kernels.mla.Z', 3)\n"
           "monkeypatch.setattr(k3lab.kernels.kda, 'W', 4)\n"
           "monkeypatch.setattr(kernelenv, 'A', 5)\nmonkeypatch.setattr(runner, 'B', 6)\n")
    assert [hit.split(":")[0] for hit in _kernel_patches(ast.parse(src))] == ["5", "6", "7", "8"]


def test_no_work_history_in_code():
    out = subprocess.run(
        ["git", "grep", "-n", "-i", "-E", r"session ?[0-9]|\bcall [0-9]+\b|h200 call",
         "--", "kernels", "k3lab", "notebooks"],
        cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        pytest.skip(f"git grep unavailable: {out.stderr.strip()}")
    assert out.stdout == "", out.stdout


def _tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"git ls-files unavailable: {out.stderr.strip()}")
    return out.stdout.splitlines()


def test_no_folder_named_after_a_work_period():
    parts = {part for f in _tree_files() for part in pathlib.PurePath(f).parts}
    names = sorted(p for p in parts if re.search(r"session|^next$|_call\d", p, re.I))
    assert not names, names
