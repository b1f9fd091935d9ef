"""bench.gpu_wheels: which packages the GPU machine's image holds, and which requirements of a wheel it needs."""

import zipfile

from bench.gpu_wheels import fetch, image_packages, requirements_of


def test_image_packages_reads_the_last_packages_line(tmp_path):
    kinds = tmp_path / "KINDS.md"
    kinds.write_text(
        "intro Packages: old\n\n## Python packages\nimage: Packages: PyYAML, torch, ruamel.yaml, typing_extensions.\n"
    )
    assert image_packages(kinds) == {"pyyaml", "torch", "ruamel-yaml", "typing-extensions"}


def test_requirements_of_keeps_those_whose_markers_hold_on_the_gpu_machine(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    metadata = [
        "Metadata-Version: 2.1",
        "Name: demo",
        "Requires-Dist: lilcom>=1.8",
        'Requires-Dist: tomli; python_version < "3.11"',
        'Requires-Dist: pywin32; sys_platform == "win32"',
        'Requires-Dist: pytest; extra == "dev"',
        'Requires-Dist: cytoolz>=0.10; python_version >= "3.8"',
    ]
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo-1.0.dist-info/METADATA", "\n".join(metadata) + "\n")
    assert [str(r) for r in requirements_of(wheel)] == ["lilcom>=1.8", 'cytoolz>=0.10; python_version >= "3.8"']


def test_fetch_clears_wheels_left_from_an_earlier_fetch(tmp_path):
    """Two versions of one package in the folder would stop the install on the GPU machine."""
    (tmp_path / "sqlalchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("kept")
    assert fetch([], set(), tmp_path) == []
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]
