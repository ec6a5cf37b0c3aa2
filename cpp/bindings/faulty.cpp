// Bindings of the fault-injecting upstream (poolkeeper._core.FaultyUpstream); the documented
// Python class is poolkeeper.faulty.Faulty.
#include <nanobind/stl/shared_ptr.h>

#include "bindings.hpp"
#include "poolkeeper/upstreams/faulty_upstream.hpp"

namespace poolkeeper::py {

namespace {
FaultPlan read_plan(nb::handle fail_every, nb::handle fail_at, nb::handle fail_bytes_over, bool fail_frees,
                    const std::string& error, bool armed, nb::handle refuse_after_us) {
  FaultPlan plan;
  if (!fail_every.is_none()) {
    plan.fail_every = parse_size(fail_every, "fail_every");
    if (!plan.fail_every) throw InvalidArgument("fail_every must be a positive number of calls; got 0");
  }
  if (!fail_at.is_none()) {
    if (PyUnicode_Check(fail_at.ptr()) || PyBytes_Check(fail_at.ptr()))
      throw InvalidArgument("fail_at must be a collection of call indices, not a string");
    PyObject* it = PyObject_GetIter(fail_at.ptr());
    if (!it) {
      clear_bad_input_error();
      throw InvalidArgument("fail_at must be a collection of call indices (ints >= 0)");
    }
    nb::object iter = nb::steal(it);
    while (PyObject* item = PyIter_Next(iter.ptr())) {
      nb::object o = nb::steal(item);
      int of = 0;
      if (PyBool_Check(o.ptr()) || !PyLong_Check(o.ptr()))
        throw InvalidArgument("fail_at holds call indices (ints >= 0); got " + shown(o));
      const long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &of);
      if (of || v < 0)
        throw InvalidArgument("fail_at holds call indices (ints >= 0); got " + shown(o));
      plan.fail_at.push_back(static_cast<std::uint64_t>(v));
    }
    if (PyErr_Occurred()) throw nb::python_error();
  }
  if (!fail_bytes_over.is_none()) plan.fail_bytes_over = parse_size(fail_bytes_over, "fail_bytes_over");
  plan.fail_frees = fail_frees;
  if (error == "oom") plan.error = FaultPlan::Error::Oom;
  else if (error == "upstream") plan.error = FaultPlan::Error::Failure;
  else throw InvalidArgument("error must be 'oom' or 'upstream'; got '" + error + "'");
  plan.armed = armed;
  if (!refuse_after_us.is_none()) {
    plan.refuse_after_us = parse_size(refuse_after_us, "refuse_after_us");
    // The sleep cannot be interrupted (it may run under a pool lock, or with the GIL held):
    // kept short enough that a mistaken value does not hang a test run for long.
    if (plan.refuse_after_us > 10'000'000)
      throw InvalidArgument("refuse_after_us must be at most 10,000,000 (ten seconds); got " +
                            std::to_string(plan.refuse_after_us));
  }
  return plan;
}
}  // namespace

void bind_faulty(nb::module_& m) {
  nb::class_<FaultyUpstream, Upstream>(m, "FaultyUpstream")
      .def(
          "__init__",
          [](FaultyUpstream* self, nb::handle inner, nb::handle fail_every, nb::handle fail_at,
             nb::handle fail_bytes_over, bool fail_frees, nb::handle error, bool armed, nb::handle refuse_after_us) {
            // Converted here, not by nanobind, so a wrong inner or error is an InvalidArgumentError.
            if (!nb::isinstance<Upstream>(inner))
              throw InvalidArgument("Faulty needs an inner upstream (e.g. poolkeeper.upstream.Host()); got " +
                                    shown(inner));
            if (!nb::isinstance<nb::str>(error))
              throw InvalidArgument("error must be 'oom' or 'upstream'; got " + shown(error));
            FaultPlan plan =
                read_plan(fail_every, fail_at, fail_bytes_over, fail_frees, nb::cast<std::string>(error), armed,
                          refuse_after_us);
            new (self) FaultyUpstream(nb::cast<std::shared_ptr<Upstream>>(inner), std::move(plan));
          },
          "inner"_a.none(), "fail_every"_a = nb::none(), "fail_at"_a = nb::none(), "fail_bytes_over"_a = nb::none(),
          "fail_frees"_a = false, "error"_a.none() = "oom", "armed"_a = true, "refuse_after_us"_a.none() = nb::none())
      .def_prop_ro("inner", [](FaultyUpstream& f) { return f.inner(); })
      .def_prop_rw("armed", &FaultyUpstream::armed, &FaultyUpstream::set_armed)
      .def_prop_ro("calls", &FaultyUpstream::calls)
      .def_prop_ro("injected", &FaultyUpstream::injected)
      .def_prop_ro("injected_allocations", &FaultyUpstream::injected_allocations)
      .def_prop_ro("injected_deallocations", &FaultyUpstream::injected_deallocations)
      .def_prop_ro("fail_every", [](FaultyUpstream& f) -> nb::object {
        return f.plan().fail_every ? nb::object(nb::int_(f.plan().fail_every)) : nb::none();
      })
      .def_prop_ro("fail_at", [](FaultyUpstream& f) {
        nb::list l;
        for (auto i : f.plan().fail_at) l.append(nb::int_(i));
        return nb::steal(PyFrozenSet_New(l.ptr()));
      })
      .def_prop_ro("fail_bytes_over", [](FaultyUpstream& f) -> nb::object {
        return f.plan().fail_bytes_over ? nb::object(nb::int_(f.plan().fail_bytes_over)) : nb::none();
      })
      .def_prop_ro("fail_frees", [](FaultyUpstream& f) { return f.plan().fail_frees; })
      .def_prop_ro("refuse_after_us", [](FaultyUpstream& f) { return f.plan().refuse_after_us; })
      .def_prop_ro("error", [](FaultyUpstream& f) {
        return std::string(f.plan().error == FaultPlan::Error::Oom ? "oom" : "upstream");
      });
}

}  // namespace poolkeeper::py

// Called from NB_MODULE in module.cpp through a one-line block-scope declaration, so adding the
// fault injector touches one line of the shared module file.
void bind_faulty(nanobind::module_& m) { poolkeeper::py::bind_faulty(m); }
