"""A stream checkpoint's files held in memory, for unit tests of checkpoint readers."""

from __future__ import annotations


class Files:
    """A checkpoint's files held in a dict (path -> text); folders are implied."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def list_names(self, path: str) -> list[str] | None:
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self.files if p.startswith(prefix)}
        return sorted(names) or None

    def read_text_if_exists(self, path: str) -> str | None:
        return self.files.get(path)
