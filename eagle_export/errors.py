"""User-facing errors: each names the problem and the fix. The CLI prints them without a traceback."""


class EagleExportError(Exception):
    """An error caused by the user's input (a checkpoint, a recipe, a prompt), with its fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem}\n  fix: {fix}")


# The rebuild a module names where it does not know the build directory (an engine, a graph session);
# `open_build` puts the build's own command in its place (`manifest.rebuild_hint`).
REBUILD = "`eagle-export build --force`"


class CheckpointError(EagleExportError):
    """A checkpoint directory that cannot be loaded as asked."""
