"""A stand-in for the `tensorrt` module, for CPU tests of the thin TensorRT layer.

It answers the TensorRT 10.x Python API calls the project makes with their documented return
values (`set_input_shape` / `set_tensor_address` / `set_optimization_profile_async` /
`execute_async_v3` return bools; `get_tensor_profile_shape` gives [min, opt, max]), for an engine
described by a contract GraphSpec and the profiles the project computes for it. Every context call
is recorded, so a test can check what was bound, with which shapes, on which stream. It computes
nothing: outputs are left as allocated.
"""

from __future__ import annotations

import enum
import types

from eagle_export.models import contract as C

DataType = enum.Enum("DataType", "FLOAT HALF BF16 INT64 INT32 BOOL")
TensorIOMode = enum.Enum("TensorIOMode", "INPUT OUTPUT")
TensorLocation = enum.Enum("TensorLocation", "DEVICE HOST")
_DTYPES = {"int64": DataType.INT64, "float32": DataType.FLOAT, "bool": DataType.BOOL}


class FakeEngine:
    def __init__(self, spec: C.GraphSpec, profiles: list[dict], model_dtype: str, speculation,
                 location: TensorLocation = TensorLocation.HOST):
        """model_dtype: the DataType name of the graph's MODEL_DTYPE tensors; speculation: the build's
        tree.Speculation (a drafter engine's new K/V rows are its input rows plus `step_rows`);
        location: where every tensor lives (HOST lets CPU torch tensors bind; a real engine of ours
        says DEVICE)."""
        self.spec, self.profiles, self.speculation, self.location = spec, profiles, speculation, location
        self.tensors = list(spec.inputs) + list(spec.outputs)
        self.dtypes = {t.name: _DTYPES.get(t.dtype, DataType[model_dtype]) for t in self.tensors}
        self.contexts = []

    num_io_tensors = property(lambda self: len(self.tensors))

    def get_tensor_name(self, i):
        return self.tensors[i].name

    def get_tensor_mode(self, name):
        return TensorIOMode.INPUT if name in self.spec.input_names else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def get_tensor_location(self, name):
        return self.location

    def get_tensor_profile_shape(self, name, profile):
        return [list(shape) for shape in self.profiles[profile][name]]

    def create_execution_context(self):
        self.contexts.append(FakeContext(self))
        return self.contexts[-1]


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile, self.shapes, self.addresses, self.calls = engine, 0, {}, {}, []
        self.refuse_address = set()  # tensor names whose set_tensor_address returns False

    def set_optimization_profile_async(self, profile, stream):
        self.calls.append(("set_optimization_profile_async", profile, stream))
        if not 0 <= profile < len(self.engine.profiles):
            return False
        self.profile = profile
        return True

    def set_input_shape(self, name, shape):
        self.calls.append(("set_input_shape", name, tuple(shape)))
        lo, _, hi = self.engine.profiles[self.profile].get(name, (shape, shape, shape))
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.calls.append(("set_tensor_address", name, address))
        self.addresses[name] = address
        return name not in self.refuse_address

    def get_tensor_shape(self, name):
        """An output's shape from the input shapes set, by the contract's axis names."""
        axes = {}
        for t in self.engine.spec.inputs:
            axes.update({axis: self.shapes[t.name][i] for i, axis in t.dynamic_axes.items()})
        axes[C.DRAFTER_NEW_ROWS] = axes[C.TOKENS] + self.engine.speculation.step_rows
        return [axes[d] if isinstance(d, str) else d for d in self.engine.spec[name].shape]

    def execute_async_v3(self, stream):
        self.calls.append(("execute_async_v3", stream))
        return True


class _Logger:
    WARNING = 2

    def __init__(self, severity=WARNING):
        pass


def module(engines: dict[bytes, FakeEngine]):
    """A `tensorrt` module whose Runtime deserializes an engine file's bytes to engines[bytes]
    (None, as TensorRT returns, for any other bytes)."""

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return engines.get(bytes(data))

    return types.SimpleNamespace(__version__="10.13.2", Runtime=Runtime, Logger=_Logger, DataType=DataType,
                                 TensorIOMode=TensorIOMode, TensorLocation=TensorLocation)
