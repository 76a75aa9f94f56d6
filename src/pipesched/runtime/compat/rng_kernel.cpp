// pipesched's kernel for random operations at the dispatch key CustomRNGKeyId.
//
// Why C++: a Python kernel costs a call into Python per random operation, its
// arguments converted both ways (about 20 us per draw, 5% of a small Transformer's
// step before any seeding), and with stages in threads each call into Python waits
// for the GIL. Here a draw on the CPU from a default generator is keyed and seeded
// without Python: its place is found on this thread's own call stack (Keys, the twin
// of draw_keys.DrawContext.seed_for), this thread's own generator is seeded with its
// seed, and the operation runs with it. Everything else (a user's generator, another
// device, a step whose seed is not known yet, a pass that learns what drew) goes to
// the Python kernel, with the arguments and results converted as torch's own Python
// kernels convert them. The masks are the same either way: one Keys counts every draw
// of a pass, and seeding a CPU generator is torch.Generator.manual_seed's
// set_current_seed.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

// This thread's Python frames, read without the GIL: only this thread changes them, and it
// is in here, inside an operation, while they are read; nothing is written, no reference
// counted. Their layout is CPython's own (the headers of the Python the library is built
// for: it is kept per Python version), so a probe (draw_keys._walks_agree) checks this walk
// against the Python one before any pipeline uses it.
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

namespace py = pybind11;
constexpr auto kKey = c10::DispatchKey::CustomRNGKeyId;

#if PY_VERSION_HEX >= 0x030D0000
_PyInterpreterFrame* currentFrame(PyThreadState* state) {
  return state->current_frame;
}
PyCodeObject* codeOf(_PyInterpreterFrame* frame) {
  return _PyFrame_GetCode(frame);
}
#elif PY_VERSION_HEX >= 0x030B0000
_PyInterpreterFrame* currentFrame(PyThreadState* state) {
  return state->cframe->current_frame;
}
PyCodeObject* codeOf(_PyInterpreterFrame* frame) {
  return frame->f_code;
}
#else
#error "pipesched's kernel reads frames as CPython 3.11 to 3.13 lay them out"
#endif

// The first complete frame from `frame` on (what a frame object's f_back finds).
_PyInterpreterFrame* complete(_PyInterpreterFrame* frame) {
  while (frame != nullptr && _PyFrame_IsIncomplete(frame)) {
    frame = frame->previous;
  }
  return frame;
}

// What frame.f_locals.get("self") is in a frame whose code's first argument is named
// "self" (nullptr: not such a frame, or self unbound). A self that a closure captures is
// held in a cell.
PyObject* selfOf(_PyInterpreterFrame* frame) {
  PyCodeObject* code = codeOf(frame);
  if (code->co_argcount == 0) {
    return nullptr;
  }
  PyObject* name = PyTuple_GET_ITEM(code->co_localsplusnames, 0);
  if (!PyUnicode_IS_COMPACT_ASCII(name) || PyUnicode_GET_LENGTH(name) != 4 ||
      std::memcmp(PyUnicode_DATA(name), "self", 4) != 0) {
    return nullptr;
  }
  PyObject* value = frame->localsplus[0];
  if (value != nullptr && PyCell_Check(value)) {
    value = PyCell_GET(value);
  }
  return value;
}

uint64_t mix(uint64_t z) {  // draw_keys._mix: SplitMix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A stage's places for Keys (draw_keys.module_names, as draw_keys.native_names gives them):
// each module's name as an index, each name's hash, the name its user-generator draws count
// under (name + "#generator").
struct Names {
  std::unordered_map<const PyObject*, int> index;  // module -> name
  std::vector<uint64_t> hashes;  // name -> draw_keys._hash(name)
  std::vector<int> user;  // name -> the index of name + "#generator"
  int nameless = 0;  // "": a draw inside none of the modules
  py::object checkpoint;  // torch.utils.checkpoint.checkpoint's code (held)
};

std::shared_ptr<Names> makeNames(
    const std::vector<std::pair<uintptr_t, int>>& index,
    std::vector<uint64_t> hashes,
    std::vector<int> user,
    int nameless,
    py::object checkpoint) {
  auto names = std::make_shared<Names>();
  for (const auto& [module, name] : index) {
    names->index.emplace(reinterpret_cast<const PyObject*>(module), name);
  }
  names->hashes = std::move(hashes);
  names->user = std::move(user);
  names->nameless = nameless;
  names->checkpoint = std::move(checkpoint);
  return names;
}

// One pass's keys (draw_keys.DrawContext, whose twin it is): what the next draw from a
// frame is seeded with. Used by one thread: the one running the pass.
class Keys {
 public:
  Keys(std::shared_ptr<const Names> names, uint64_t microbatch, uint64_t place, py::object entry)
      : names_(std::move(names)),
        microbatch_(microbatch),
        place_(place),
        entry_(std::move(entry)),
        counts_(names_->hashes.size(), 0) {}

  // DrawContext.seed_for from `frame`: false where `only` leaves the draw unseeded, else
  // the seed and the module (nullptr: none). Calls no Python and needs no GIL.
  bool seedFor(
      _PyInterpreterFrame* frame, uint64_t value, bool user, uint64_t* seed, PyObject** module) {
    const _PyInterpreterFrame* entry = entry_.is_none()
        ? nullptr
        : reinterpret_cast<PyFrameObject*>(entry_.ptr())->f_frame;
    const PyObject* checkpoint = names_->checkpoint.ptr();
    int name = names_->nameless;
    PyObject* innermost = nullptr;
    bool covered = !only_.has_value();
    bool inside = false;  // inside a torch.utils.checkpoint the pass runs
    for (frame = complete(frame); frame != nullptr && frame != entry;
         frame = complete(frame->previous)) {
      if (reinterpret_cast<PyObject*>(codeOf(frame)) == checkpoint) {
        inside = true;
        break;
      }
      PyObject* self = selfOf(frame);  // a method of one of the model's modules?
      if (self == nullptr) {
        continue;
      }
      auto found = names_->index.find(self);
      if (found == names_->index.end()) {
        continue;
      }
      if (innermost == nullptr) {
        name = found->second;
        innermost = self;
      }
      covered = covered || only_->count(self) > 0;
      if (covered) {
        break;
      }
    }
    for (; !inside && !checkpointed_ && frame != nullptr && frame != entry;
         frame = complete(frame->previous)) {  // the rest of the stack: only for a checkpoint
      inside = reinterpret_cast<PyObject*>(codeOf(frame)) == checkpoint;
    }
    checkpointed_ = checkpointed_ || inside;
    if (!covered) {
      return false;
    }
    if (user) {  // draws from a user's generator are counted apart
      name = names_->user[name];
    }
    const uint64_t count = static_cast<uint64_t>(counts_[name]++);
    auto base = bases_.find(value);
    if (base == bases_.end()) {  // once per pass and step seed
      base = bases_.emplace(value, mix(mix(mix(value) ^ microbatch_) ^ place_)).first;
    }
    *seed = mix((base->second ^ names_->hashes[name]) + count) >> 1;
    *module = innermost;
    return true;
  }

  // The seed of a draw this thread makes now from a default generator (SeededRandomness's
  // fast path): false where the Python kernel must make it (the step's seed not kept yet,
  // the pass learns whether operations drew, no Python frame); true with *unseeded where
  // `only` leaves it unseeded.
  bool fastSeed(uint64_t* seed, bool* unseeded) {
    if (learns_ || !known_.has_value()) {
      return false;
    }
    PyThreadState* state = PyGILState_GetThisThreadState();
    _PyInterpreterFrame* frame = state == nullptr ? nullptr : complete(currentFrame(state));
    if (frame == nullptr) {
      return false;
    }
    PyObject* module = nullptr;
    *unseeded = !seedFor(frame, *known_, false, seed, &module);
    if (!*unseeded) {
      drawn_.insert(module);
    }
    return true;
  }

  py::object pySeedFor(py::object frame, uint64_t value, bool user) {
    uint64_t seed = 0;
    PyObject* module = nullptr;
    auto* start =
        frame.is_none() ? nullptr : reinterpret_cast<PyFrameObject*>(frame.ptr())->f_frame;
    if (!seedFor(start, value, user, &seed, &module)) {
      return py::none();
    }
    return py::make_tuple(
        seed, module == nullptr ? py::none() : py::reinterpret_borrow<py::object>(module));
  }

  void setOnly(py::object only) {
    only_.reset();
    if (!only.is_none()) {
      only_.emplace();
      for (py::handle ident : only) {
        only_->insert(reinterpret_cast<const PyObject*>(ident.cast<uintptr_t>()));
      }
    }
  }

  // The modules this kernel's draws drew in (None: in none): the model's named modules,
  // which their stage keeps alive.
  py::list drawn() const {
    py::list modules;
    for (PyObject* module : drawn_) {
      modules.append(module == nullptr ? py::none() : py::reinterpret_borrow<py::object>(module));
    }
    return modules;
  }

  bool learns_ = true;
  std::optional<uint64_t> known_;  // the step's seed, once kept (StepSeed.keep)
  bool checkpointed_ = false;

 private:
  std::shared_ptr<const Names> names_;
  uint64_t microbatch_;
  uint64_t place_;
  py::object entry_;  // the frame running the pass (None: none): the walk stops there
  std::vector<int64_t> counts_;  // draws so far per name
  std::unordered_map<uint64_t, uint64_t> bases_;  // step seed -> it mixed with the pass's
  std::optional<std::unordered_set<const PyObject*>> only_;
  std::unordered_set<PyObject*> drawn_;
};

// This thread's keys: the Python object (a strong reference) and the Keys in it; nullptr:
// every draw takes the Python kernel.
thread_local PyObject* tl_keys_object = nullptr;
thread_local Keys* tl_keys = nullptr;
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
    if (tl_keys != nullptr && generator_ >= 0 && fast(op, keys, stack)) {
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
    bool unseeded = false;
    if (!tl_keys->fastSeed(&seed, &unseeded)) {
      return false;
    }
    const bool seeded = !unseeded;
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

// The states of some generators when it is made (stage.tripwire.Tripwire's): taken and
// compared in one call each, where each call from Python costs several microseconds in a
// stage thread beside another. A CPU generator's state is copied from its engine,
// not serialized into a tensor: an allocation costs 10-20 us in a stage thread beside
// another (its cache cold), the copy a few hundred ns. Tensors are made only for a
// generator that moved (rare: a step seed's draw), exactly as Generator.get_state makes them.
class States {
 public:
  explicit States(const py::list& generators) {
    for (const py::handle& object : generators) {
      if (!THPGenerator_Check(object.ptr())) {
        throw py::type_error("States: generators must be torch.Generator objects");
      }
      at::Generator generator = reinterpret_cast<THPGenerator*>(object.ptr())->cdata;
      states_.push_back(stateOf(generator));
      generators_.push_back(std::move(generator));
    }
  }

  // The generators whose state moved: (position, state then, state now), the states as
  // Generator.get_state gives them.
  py::list moved() {
    py::list found;
    for (size_t i = 0; i < generators_.size(); ++i) {
      State now = stateOf(generators_[i]);
      if (!same(states_[i], now)) {
        found.append(py::make_tuple(i, tensorOf(states_[i]), tensorOf(now)));
      }
    }
    return found;
  }

 private:
  // A CPU generator's engine and cached normal samples (all its get_state serializes);
  // any other generator's get_state.
  struct State {
    bool cpu = false;
    at::mt19937_data_pod engine{};
    std::optional<float> float_normal;
    std::optional<double> double_normal;
    at::Tensor tensor;
  };

  static State stateOf(at::Generator& generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());  // as Generator.get_state locks
    State state;
    if (generator.device().is_cpu()) {
      auto* cpu = generator.get<at::CPUGeneratorImpl>();
      state.cpu = true;
      state.engine = cpu->engine().data();
      state.float_normal = cpu->next_float_normal_sample();
      state.double_normal = cpu->next_double_normal_sample();
    } else {
      state.tensor = generator.get_state();
    }
    return state;
  }

  static bool same(const State& a, const State& b) {
    if (!a.cpu) {
      return a.tensor.nbytes() == b.tensor.nbytes() &&
          std::memcmp(a.tensor.const_data_ptr(), b.tensor.const_data_ptr(), a.tensor.nbytes()) ==
          0;
    }
    const auto& x = a.engine;
    const auto& y = b.engine;
    return x.seed_ == y.seed_ && x.left_ == y.left_ && x.seeded_ == y.seeded_ &&
        x.next_ == y.next_ && x.state_ == y.state_ && a.float_normal == b.float_normal &&
        a.double_normal == b.double_normal;
  }

  // What Generator.get_state returns for `state`: a CPU one through a scratch generator
  // given that engine and those samples (get_state serializes nothing else).
  static at::Tensor tensorOf(const State& state) {
    if (!state.cpu) {
      return state.tensor;
    }
    at::Generator scratch = at::detail::createCPUGenerator();
    auto* cpu = scratch.get<at::CPUGeneratorImpl>();
    at::mt19937 engine;
    engine.set_data(state.engine);
    cpu->set_engine(engine);
    cpu->set_next_float_normal_sample(state.float_normal);
    cpu->set_next_double_normal_sample(state.double_normal);
    return scratch.get_state();
  }

  std::vector<at::Generator> generators_;
  std::vector<State> states_;
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

// Sets this thread's keys (None: none); returns the previous ones.
py::object keys_here(py::object keys) {
  py::object previous = tl_keys_object == nullptr
      ? py::none()
      : py::reinterpret_steal<py::object>(tl_keys_object);
  tl_keys_object = nullptr;
  tl_keys = nullptr;
  if (!keys.is_none()) {
    tl_keys = keys.cast<Keys*>();
    tl_keys_object = keys.release().ptr();
  }
  return previous;
}

// SeededRandomness's entry in one call (each call from Python costs several microseconds
// in a stage thread beside another): this thread's random operations routed here, keyed
// by `keys`; returns what seedNoMore puts back (whether routing was on, the previous keys).
py::tuple seedHere(py::object keys) {
  const bool was = c10::impl::tls_is_dispatch_key_included(kKey);
  c10::impl::tls_set_dispatch_key_included(kKey, true);
  return py::make_tuple(was, keys_here(std::move(keys)));
}

// SeededRandomness's exit: routing and keys as seedHere found them.
void seedNoMore(bool was, py::object keys) {
  c10::impl::tls_set_dispatch_key_included(kKey, was);
  keys_here(std::move(keys));
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
  m.def("keys_here", &keys_here, "Sets this thread's Keys (None: none); returns the previous.");
  m.def("seed_here", &seedHere, "Routing on here, keyed by these Keys: (was on, previous keys).");
  m.def("seed_no_more", &seedNoMore, "Routing and keys back as seed_here found them.");
  py::class_<Names, std::shared_ptr<Names>>(m, "Names")
      .def(py::init(&makeNames),
           "(module id, name index) pairs, hashes, user-generator name indices, the nameless "
           "name's index, torch.utils.checkpoint's code.");
  py::class_<Keys>(m, "Keys")
      .def(py::init([](std::shared_ptr<Names> names, uint64_t microbatch, uint64_t place,
                       py::object entry, py::object only, bool learns) {
             auto* keys = new Keys(std::move(names), microbatch, place, std::move(entry));
             keys->setOnly(std::move(only));
             keys->learns_ = learns;
             return keys;
           }),
           py::arg("names"), py::arg("microbatch"), py::arg("place"), py::arg("entry"),
           py::arg("only") = py::none(), py::arg("learns") = true)
      .def("seed_for", &Keys::pySeedFor, "DrawContext.seed_for: (seed, module) or None.")
      .def("set_only", &Keys::setOnly, "Seed only draws inside these module ids (None: all).")
      .def("drawn", &Keys::drawn, "The modules the C++ kernel's draws drew in (None: none).")
      .def_readwrite("learns", &Keys::learns_)
      .def_readwrite("known", &Keys::known_)
      .def_readonly("checkpointed", &Keys::checkpointed_);
  py::class_<States>(m, "States")
      .def(py::init<const py::list&>(), "The generators' states now.")
      .def("moved", &States::moved, "The generators moved since: (position, then, now).");
  m.def("draws", &draws, "(draws seeded in C++, draws that took the Python kernel).");
}
