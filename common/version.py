"""InstaSlice's version: the one place it is written (docs/release.md).

pyproject.toml reads it (`[tool.setuptools.dynamic]`), and from there: the wheel, the Helm
chart's `version`/`appVersion` (hack/gen_chart.py), the images' `version` label and tag (`make
images`/`make release` pass it as a build argument), the node agent's MigNode `status.agent`,
the krew manifest and archive name (plugins/krew/build-archive.sh) and `kubectl instaslice
version`. A plain literal, so setuptools and the shell scripts read it without importing.
"""

VERSION = "0.1.0"
