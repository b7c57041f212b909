"""LogicPipe. This package's own modules are the contract the processes agree on: the protobuf
messages and services (v1), the tensor codec, error types, ids, sampling parameters and the role
policy. The processes are its subpackages: controller, stage_node, planner, and common (what
both processes run on)."""
__version__ = "0.1.0"
