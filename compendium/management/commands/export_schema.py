import os
import stat
import tempfile
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from compendium.services import current_schema


class Command(BaseCommand):
    help = "Write the schema S in force (registry, numeric fields, limits) as JSON for clients."

    def add_arguments(self, parser):
        parser.add_argument("--out", default="-", help="file to write, or - for standard output")

    def handle(self, *args, out, **options):
        text = current_schema().model_dump_json(indent=2)
        if out == "-":
            self.stdout.write(text)
            return
        try:
            _write(Path(out), text.encode("utf-8"))
        except OSError as exc:
            raise CommandError(
                f"cannot write the schema to {out}: {exc.strerror or exc}"
            ) from None
        self.stdout.write(f"schema written to {out}")


def _write(path: Path, data: bytes) -> None:
    """A regular file (new, or through a link) is written beside and renamed over, so that a
    write that fails (the disk full) leaves the schema it held, not half a JSON document that
    clients then fail to read; a device or a pipe (/dev/stdout) is written to as it is."""
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = stat.S_IFREG | (0o666 & ~umask)
    if not stat.S_ISREG(mode):
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory")
        with open(target, "wb") as handle:
            handle.write(data)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.chmod(tmp, stat.S_IMODE(mode))
            handle.write(data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
