// pipesched's kernel for random operations at the dispatch key CustomRNGKeyId.
//
// Why C++: a Python kernel costs a call into Python per random operation, its
// arguments converted both ways (about 20 us per draw, 5% of a small Transformer's
// step before any seeding). Here a draw on the CPU asks Python for its seed only
// (one call, no arguments), seeds this thread's own generator and runs the
// operation with it. Everything else (a user's generator, another device, a step
// whose seed is not drawn yet, a pass that learns what drew) goes to the Python
// kernel, with the arguments and results converted as torch's own Python kernels
// convert them. The masks are the same either way: the seed is Python's, and
// seeding a CPU generator is torch.Generator.manual_seed's set_current_seed.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;
constexpr auto kKey = c10::DispatchKey::CustomRNGKeyId;

// This thread's seed callback (a strong reference; nullptr: every draw takes the Python
// kernel): () -> int seed | None (run unseeded) | -1 (take the Python kernel).
thread_local PyObject* tl_seed = nullptr;
thread_local std::optional<at::Generator> tl_cpu;  // this thread's own CPU generator

std::atomic<int64_t> fast_draws{0};
std::atomic<int64_t> python_draws{0};
// Never destroyed: at exit the dispatcher may be gone before a static vector would be.
auto* registrations = new std::vector<c10::RegistrationHandleRAII>();

class RandomKernel final : public c10::OperatorKernel {
 public:
  // `python`: the Python kernel, (keyset, *args, **kwargs); kept alive for good (a kernel
  // may outlive the interpreter's last reference at exit). `generator`: the position of the
  // operation's generator= argument, -1 if it has none.
  RandomKernel(PyObject* python, int generator) : python_(python), generator_(generator) {
    Py_INCREF(python_);
  }

  void operator()(
      const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (tl_seed != nullptr && generator_ >= 0 && fast(op, keys, stack)) {
      return;
    }
    viaPython(op, keys, stack);
  }

 private:
  // A draw on the CPU from a default generator: seeded here. False: not one (untouched).
  bool fast(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    const auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
    c10::IValue& generator = *(first + generator_);
    if (!generator.isNone() || !onCpu(op, first, n)) {
      return false;
    }
    uint64_t seed = 0;
    bool seeded = true;
    {
      py::gil_scoped_acquire gil;
      c10::impl::ExcludeDispatchKeyGuard exclude(kKey);
      PyObject* answer = PyObject_CallNoArgs(tl_seed);
      if (answer == nullptr) {
        throw py::error_already_set();
      }
      if (answer == Py_None) {
        seeded = false;
      } else {
        int overflow = 0;
        const long long value = PyLong_AsLongLongAndOverflow(answer, &overflow);
        if (value == -1 && overflow == 0) {  // the Python kernel's draw
          Py_DECREF(answer);
          if (PyErr_Occurred()) {
            throw py::error_already_set();
          }
          return false;
        }
        seed = PyLong_AsUnsignedLongLong(answer);
        if (PyErr_Occurred()) {
          Py_DECREF(answer);
          throw py::error_already_set();
        }
      }
      Py_DECREF(answer);
    }
    if (seeded) {
      if (!tl_cpu.has_value()) {
        tl_cpu = at::detail::createCPUGenerator();
      }
      {
        std::lock_guard<std::mutex> lock(tl_cpu->mutex());
        tl_cpu->set_current_seed(seed);
      }
      generator = c10::IValue(*tl_cpu);
    }
    c10::impl::ExcludeDispatchKeyGuard exclude(kKey);
    op.redispatchBoxed(keys.remove(kKey), stack);
    fast_draws.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Where the Python kernel would look: the first tensor argument's device, else the
  // device= argument's (none: the CPU).
  static bool onCpu(
      const c10::OperatorHandle& op, std::vector<c10::IValue>::iterator first, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& value = *(first + static_cast<std::ptrdiff_t>(i));
      if (value.isTensor()) {
        return value.toTensor().device().is_cpu();
      }
    }
    const auto& arguments = op.schema().arguments();
    for (size_t i = 0; i < n; ++i) {
      if (arguments[i].name() == "device") {
        const c10::IValue& value = *(first + static_cast<std::ptrdiff_t>(i));
        return value.isNone() || value.toDevice().is_cpu();
      }
    }
    return true;
  }

  // The Python kernel: arguments converted as torch's Python kernels get them (keyword-only
  // ones as keywords), its result converted back by the operation's return types.
  void viaPython(
      const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const auto& declared = schema.arguments();
    auto arguments = torch::jit::pop(*stack, declared.size());
    // As torch's parseIValuesToPyArgsKwargs: arguments left at their defaults are left out
    // (trailing positional ones, and keyword-only ones), so a kernel that sets generator=
    // as a keyword never meets it positionally too.
    auto is_default = [&](size_t i) {
      const auto& value = declared[i].default_value();
      return value.has_value() && *value == arguments[i];
    };
    size_t keyword_start = arguments.size();
    while (keyword_start > 0 && declared[keyword_start - 1].kwarg_only()) {
      --keyword_start;
    }
    size_t positional_end = keyword_start;
    while (positional_end > 0 && is_default(positional_end - 1)) {
      --positional_end;
    }
    py::gil_scoped_acquire gil;
    py::list positional;
    py::dict keywords;
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (i >= positional_end && i < keyword_start) {
        continue;
      }
      if (i >= keyword_start && is_default(i)) {
        continue;
      }
      py::object value = torch::jit::toPyObject(std::move(arguments[i]));
      if (i >= keyword_start) {
        keywords[py::str(declared[i].name())] = value;
      } else {
        positional.append(value);
      }
    }
    py::object out = py::reinterpret_borrow<py::object>(python_)(
        py::cast(keys), *py::tuple(positional), **keywords);
    const auto& returns = schema.returns();
    if (returns.size() == 1) {
      stack->push_back(torch::jit::toIValue(out, returns[0].type()));
    } else if (!returns.empty()) {
      py::tuple values = out.cast<py::tuple>();
      for (size_t i = 0; i < returns.size(); ++i) {
        stack->push_back(torch::jit::toIValue(values[i], returns[i].type()));
      }
    }
    python_draws.fetch_add(1, std::memory_order_relaxed);
  }

  PyObject* python_;
  int generator_;
};

// Puts `python` (the operation's Python kernel) behind this kernel at the key for the
// operation `name` ("aten::bernoulli_") of overload `overload` ("float"; "" for default).
bool route(const std::string& name, const std::string& overload, py::object python) {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op.has_value()) {
    return false;
  }
  int generator = -1;
  const auto& arguments = op->schema().arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].name() == "generator") {
      generator = static_cast<int>(i);
    }
  }
  registrations->push_back(c10::Dispatcher::singleton().registerImpl(
      op->operator_name(),
      kKey,
      c10::KernelFunction::makeFromBoxedFunctor(
          std::make_unique<RandomKernel>(python.ptr(), generator)),
      std::nullopt,
      nullptr,
      "pipesched: random operations seeded (rng_kernel.cpp)"));
  return true;
}

// Takes every kernel of this module off the key.
void unroute() {
  registrations->clear();
}

// Sets this thread's seed callback (None: none); returns the previous one.
py::object seed_with(py::object callback) {
  py::object previous =
      tl_seed == nullptr ? py::none() : py::reinterpret_steal<py::object>(tl_seed);
  tl_seed = nullptr;
  if (!callback.is_none()) {
    tl_seed = callback.release().ptr();
  }
  return previous;
}

// (draws seeded here, draws that took the Python kernel) since the process started.
std::pair<int64_t, int64_t> draws() {
  return {fast_draws.load(), python_draws.load()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipesched's kernel for random operations (see rng_kernel.cpp)";
  m.def("route", &route, "Routes one operation's draws through this kernel.");
  m.def("unroute", &unroute, "Takes every kernel of this module off the key.");
  m.def("seed_with", &seed_with, "Sets this thread's seed callback; returns the previous.");
  m.def("draws", &draws, "(draws seeded in C++, draws that took the Python kernel).");
}
