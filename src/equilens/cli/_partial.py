"""What an interrupted run (Ctrl-C) writes."""

import os
from typing import Any


class Partial:
    """What a run has finished, for an interrupted run (Ctrl-C) to write: the latest
    stage's `FitResult` as the pipeline hands it over (`keep`, the pipelines' `on_stage`),
    written by `write` as the JSON of a fit with `"status": "interrupted"`."""

    def __init__(self, json_path: str | None) -> None:
        self.json_path = json_path
        self.stage: str | None = None
        self.result: Any = None
        self.band_names: Any = None
        #: set when the run wrote its interrupted result itself (`equilens sample`)
        self.written: str | None = None

    def keep(self, stage: str, result: Any) -> None:
        self.stage, self.result = stage, result

    def write(self) -> str | None:
        """Writes the kept result (None when there is none, or no path); returns the path."""
        if self.written is not None:
            return self.written
        if self.result is None or self.json_path is None:
            return None
        from ..solve import write_json

        folder = os.path.dirname(os.path.abspath(self.json_path))
        os.makedirs(folder, exist_ok=True)
        write_json(
            self.json_path,
            self.result,
            self.band_names,
            interrupted=True,
            status=f"interrupted: the result of the pipeline's stage {self.stage!r}",
        )
        return self.json_path
