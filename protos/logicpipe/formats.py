"""The one table of dtype and weight-format names the processes agree on (the controller's --dtype
and plans, a stage's Assign and Status, tensors on the wire). The planner, which imports nothing
of LogicPipe, keeps its own bytes per format (planner.model.FORMAT_BYTES); a test holds the two
equal."""
from __future__ import annotations

FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # compute dtypes, by torch's names: --dtype, Assign, the wire
DTYPE_FORMAT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # a compute dtype -> its weight format
FORMAT_DTYPE = {fmt: dtype for dtype, fmt in DTYPE_FORMAT.items()}       # a float weight format -> its dtype
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}                # bytes per element of a compute dtype
QUANT_FORMATS = ("int4", "int8", "nf4", "fp4")     # quantized weight formats (--quantize), the layers' matrices only
WEIGHT_FORMATS = (*DTYPE_FORMAT.values(), *QUANT_FORMATS)  # every weight format a stage may hold its layers in
KV_FORMATS = ("int8", "fp8")  # 8-bit KV (a stage's --kv-dtype, its profile's kv_format); else the compute dtype
