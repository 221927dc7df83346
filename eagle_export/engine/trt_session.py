"""A TensorRT engine bound by the graph contract's tensor names: the run-time half of the TensorRT layer.

The build-time half (profiles, engine names, which engine fits this machine, building) is
`engine.py`; the TensorRT backend needs only this module, so importing the runtime loads none of it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import REBUILD, EagleExportError


class TensorRTSession:
    """An engine bound by the contract's tensor names. run() takes torch tensors in the engine's own
    dtypes on its own devices (CUDA for every tensor of our graphs), and enqueues on torch's current
    CUDA stream: the runtime writes the caches there, so the engine reads them after those writes
    without any synchronization, and torch reads the outputs after the engine wrote them."""

    def __init__(self, engine_path: Path):
        import tensorrt as trt

        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise EagleExportError(f"TensorRT cannot load {engine_path.name} (another TensorRT version or GPU, "
                                   "or a corrupt file)", f"rebuild it here with {REBUILD}")
        self.name = engine_path.name
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: _TORCH_DTYPES[self.engine.get_tensor_dtype(n).name] for n in names}
        self.devices = {n: "cuda" if self.engine.get_tensor_location(n) == trt.TensorLocation.DEVICE else "cpu"
                        for n in names}
        self.profile = None  # the optimization profile the context is set to

    def run(self, feeds: dict, profile: int = 0) -> dict:
        """Bind `feeds` (input name -> tensor; kept alive in the dict until enqueued), allocate the
        outputs and enqueue the engine on torch's current stream; returns the outputs by name."""
        stream = torch.cuda.current_stream().cuda_stream
        if profile != self.profile:
            if not self.context.set_optimization_profile_async(profile, stream):
                raise EagleExportError(f"{self.name} has no optimization profile {profile}",
                                       f"rebuild the engines with {REBUILD}")
            self.profile = profile
        for name in self.inputs:
            if name not in feeds:
                raise EagleExportError(f"{self.name} takes an input {name!r} that was not given",
                                       "this build's engines do not match this eagle-export: rebuild with --force")
            tensor = feeds[name] = self._checked(name, feeds[name].contiguous())
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                lo, _, hi = (tuple(d) for d in self.engine.get_tensor_profile_shape(name, profile))
                raise EagleExportError(
                    f"{self.name}: input {name} has shape {tuple(tensor.shape)}, outside optimization profile "
                    f"{profile} (min {lo}, max {hi})",
                    "keep batches within profiles.batch.max and prompt plus new tokens within profiles.context.max, "
                    "or rebuild with larger profiles (`eagle-export build --set profiles.context.max=N --force`)")
            self._bind(name, tensor)
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.devices[name])
            self._bind(name, outputs[name])
        if not self.context.execute_async_v3(stream):
            raise EagleExportError(f"TensorRT failed to run {self.name} (see its log above)",
                                   "run `eagle-export doctor` and report its output with this line")
        return outputs

    def _checked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor bound by address must be of the engine's dtype and on its device: TensorRT reads
        the bytes, so any other would be read as garbage, or its address fault."""
        dtype, device = self.dtypes[name], self.devices[name]
        if tensor.dtype != dtype or tensor.device.type != device:
            raise EagleExportError(f"{self.name}: input {name} is {tensor.dtype} on {tensor.device.type}, "
                                   f"the engine takes {dtype} on {device}",
                                   "open the build with open_build(), which allocates what its engines take; "
                                   "calling a session directly, convert with tensor.to(dtype, device)")
        return tensor

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, tensor.data_ptr()):
            raise EagleExportError(f"TensorRT refused the address of {self.name}'s {name} "
                                   f"({tuple(tensor.shape)} {tensor.dtype} on {tensor.device})",
                                   "this is a bug in eagle-export's TensorRT binding: report it with this line")


# TensorRT's DataType member names -> torch dtypes.
_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                 "INT64": torch.int64, "INT32": torch.int32, "BOOL": torch.bool}
