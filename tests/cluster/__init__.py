"""The Ray tests run one after another on one xdist worker (tests/conftest.py)."""
import ray


def keep_ray_for_the_next_module() -> None:
    """At a module's end, its deployments shut down: the local Ray instance this process
    started stays for the next module's deployments (a start is ~10 s of the serial
    group's time; Ray stops it when the process exits, and the modules that build a
    cluster of their own shut it down first). If anything of this module's is still
    placed, the instance goes, so the next module starts clean."""
    if not ray.is_initialized():
        return
    if any(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values()):
        ray.shutdown()
