"""The README's map of the tree names every module, so a newcomer finds each file there."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_every_module_and_package():
    readme = (ROOT / "README.md").read_text()
    missing = []
    for folder in ("k3lab", "kernels"):
        for path in sorted((ROOT / folder).iterdir()):
            if path.name.startswith(("_", ".")) or path.name == "templates":
                continue
            if path.suffix == ".py" or (path / "__init__.py").is_file():
                name = path.name if path.suffix else f"{path.name}/"
                if f"`{name}`" not in readme and f"`{folder}/{name}`" not in readme:
                    missing.append(f"{folder}/{name}")
    assert not missing, f"modules the README's tree table does not name: {missing}"
