"""What test_checkpoint_recovery.py shares with other tests (damage, make_checkpoint), here so that no test module
imports another."""
from train.formats import checkpoint, manifest


def make_checkpoint(directory, step: int, latest: bool = True):
    """A checkpoint directory with a few files and its manifest, as ``checkpoint.save`` publishes it."""
    tag = directory / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "layer_000.pt").write_bytes(bytes(range(256)) * 40)
    (tag / "optimizer_stage00_dp00.pt").write_bytes(b"state" * 1000)
    (tag / checkpoint.TRAINER_STATE).write_text('{"step": %d}' % step)
    manifest.write(tag)
    if latest:
        (directory / checkpoint.LATEST).write_text(tag.name)
    return tag


def damage(tag, how: str) -> None:
    victim = tag / "layer_000.pt"
    if how == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    elif how == "delete":
        victim.unlink()
    elif how == "flip":  # same size, one byte changed: only the checksum sees it
        data = bytearray(victim.read_bytes())
        data[5000] ^= 1
        victim.write_bytes(bytes(data))
    elif how == "no manifest":
        (tag / manifest.MANIFEST).unlink()
