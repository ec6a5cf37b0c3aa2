// Reading pool options from a Python dict: typed, validated, and unknown keys refused by name.
#pragma once
#include <set>
#include <vector>

#include "bindings.hpp"

namespace poolkeeper::py {

class OptionReader {
 public:
  explicit OptionReader(nb::handle d, std::string pool) : pool_(std::move(pool)) {
    if (!d.is_none()) dict_ = nb::borrow<nb::dict>(d);
  }
  std::size_t size(const char* key, std::size_t def, bool allow_zero = true) {
    known_.insert(key);
    if (!dict_.is_valid() || !dict_.contains(key)) return def;
    nb::handle v = dict_[key];
    if (v.is_none()) return def;
    if (allow_zero && nb::isinstance<nb::int_>(v) && !PyBool_Check(v.ptr()) && PyObject_Not(v.ptr()) == 1) return 0;
    return parse_size(v, key);
  }
  // A byte cap where None (or leaving it out) means "no cap": 0 would read as "nothing may be
  // reserved" to some and "no cap" to others, so it is refused with the spelling to use.
  std::size_t cap(const char* key, std::size_t none) {
    known_.insert(key);
    if (!dict_.is_valid() || !dict_.contains(key)) return none;
    nb::handle v = dict_[key];
    if (v.is_none()) return none;
    const std::size_t n = parse_size(v, key);
    if (n == 0)
      throw InvalidArgument(pool_ + ": option '" + key + "' of 0 would allow nothing; pass " + key +
                            "=None for no cap");
    return n;
  }
  // Whether the caller gave key (a value other than None).
  bool given(const char* key) const {
    return dict_.is_valid() && dict_.contains(key) && !nb::handle(dict_[key]).is_none();
  }
  double real(const char* key, double def) {
    known_.insert(key);
    if (!dict_.is_valid() || !dict_.contains(key)) return def;
    nb::handle v = dict_[key];
    if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())))
      throw InvalidArgument(pool_ + ": option '" + key + "' must be a number; got " + shown(v));
    const double d = PyFloat_AsDouble(v.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw InvalidArgument(pool_ + ": option '" + key + "' is out of range");
    }
    return d;
  }
  bool flag(const char* key, bool def) {
    known_.insert(key);
    if (!dict_.is_valid() || !dict_.contains(key)) return def;
    nb::handle v = dict_[key];
    if (!PyBool_Check(v.ptr()))
      throw InvalidArgument(pool_ + ": option '" + key + "' must be True or False; got " + shown(v));
    return v.ptr() == Py_True;
  }
  void finish() {
    if (!dict_.is_valid()) return;
    for (auto [k, v] : dict_) {
      const std::string key = nb::cast<std::string>(k);
      if (!known_.count(key)) {
        std::string valid;
        for (auto& s : known_) valid += (valid.empty() ? "" : ", ") + s;
        throw InvalidArgument(pool_ + ": unknown option '" + key + "' (valid: " + valid + ")");
      }
    }
  }

 private:
  nb::dict dict_;
  std::string pool_;
  std::set<std::string> known_;
};

// Each pool's options from a Python dict (one reader per pool kind, shared by the pool classes and
// the per-device factory behind the C ABI).
}  // namespace poolkeeper::py

#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/pools/direct_pool.hpp"
#include "poolkeeper/pools/size_class_pool.hpp"

namespace poolkeeper::py {
ArenaOptions arena_options(nb::handle opts);
// The ArenaPool options that shape only the expandable range: arena_options() refuses them
// without expandable=True, and Python's table of pool kinds lists them for "arena_expandable"
// (_core.EXPANDABLE_OPTIONS), so the two lists are one.
const std::vector<const char*>& expandable_options();
SizeClassOptions size_class_options(nb::handle opts);
DirectOptions direct_options(nb::handle opts);
}  // namespace poolkeeper::py
