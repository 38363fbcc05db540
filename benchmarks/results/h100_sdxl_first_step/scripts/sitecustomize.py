# Experiment only: the SDXL adapter without its non-reentrant switch (sd-scripts' own reentrant checkpoints).
import os
if os.environ.get("SDXL_KEEP_REENTRANT") == "1":
    from compile_accel.integrations import sd_scripts
    from compile_accel.adapters import ModelAdapter
    old = sd_scripts.FAMILIES["SdxlUNet2DConditionModel"]
    sd_scripts.FAMILIES["SdxlUNet2DConditionModel"] = ModelAdapter(old.blocks)
    print("sitecustomize: SDXL keeps reentrant checkpoints", flush=True)
if os.environ.get("WHOLE_CONTAINERS") == "1":
    from compile_accel import selective
    selective._inner_block_lists = lambda block: []
    print("sitecustomize: blocks mode compiles containers whole", flush=True)
