"""tests/test_accelerate.py's script under torchrun (2 ranks, gloo on CPU): fz3.accelerate's
Accelerator joins the process group from torchrun's environment (fz3.launch.init_from_env),
Accelerate then sees both processes, and the losses are plain Accelerate's. Writes each rank's
losses, grad norms and what Accelerate saw to OUT_DIR/rank{r}.json."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.test_accelerate import _script  # noqa: E402


def main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(f"{out_dir}/run", exist_ok=True)  # one folder: save_state's checkpoint is every rank's
    out = _script(rank, world, "fz3", f"{out_dir}/run")
    from accelerate.state import PartialState
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"losses": out["losses"], "norms": out["norms"], "gathered": out["gathered"],
                   "num_processes": PartialState().num_processes}, f)


if __name__ == "__main__":
    main(sys.argv[1])
