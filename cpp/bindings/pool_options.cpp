// Pool options from Python dicts: one reader per pool kind, so every entry point (the pool
// classes, the per-device factory behind the C ABI) accepts exactly the same options.
#include "options.hpp"

namespace poolkeeper::py {

namespace {
// The options every pool kind has: its alignment and its limit.
template <class O>
void read_common(OptionReader& r, O& o) {
  o.alignment = r.size("alignment", o.alignment, false);
  o.limit = r.cap("limit", 0);
}
// A kind's options: the common ones, then `rest` reads the kind's own; unknown keys refused.
template <class O, class Rest>
O read_options(nb::handle opts, const char* kind, Rest rest) {
  OptionReader r(opts, kind);
  O o;
  read_common(r, o);
  rest(r, o);
  r.finish();
  return o;
}
}  // namespace

const std::vector<const char*>& expandable_options() {
  static const std::vector<const char*> names = {"va_bytes", "step_fraction", "max_step", "map_piece", "reclaim_holes",
                                                 "release_on_grow", "stitch", "stitch_max_parts", "stitch_from",
                                                 "stitch_edge_from", "stitch_top_up", "stitch_fragments",
                                                 "stale_alias_cap"};
  return names;
}

ArenaOptions arena_options(nb::handle opts) {
  OptionReader r(opts, "ArenaPool");
  ArenaOptions o;
  read_common(r, o);
  o.initial_backing = r.size("initial_backing", o.initial_backing, false);
  o.max_backing = r.size("max_backing", o.max_backing, false);
  o.growth_factor = r.real("growth_factor", o.growth_factor);
  o.thread_cache_bytes = r.size("thread_cache_bytes", o.thread_cache_bytes);
  o.thread_cache_max_block = r.size("thread_cache_max_block", o.thread_cache_max_block);
  o.shrink_hysteresis = r.size("shrink_hysteresis", o.shrink_hysteresis);
  o.shrink_interval = r.size("shrink_interval", o.shrink_interval);
  o.oversize_threshold = r.size("oversize_threshold", o.oversize_threshold, false);
  o.expandable = r.flag("expandable", o.expandable);
  o.va_bytes = r.size("va_bytes", o.va_bytes);
  o.step_fraction = r.real("step_fraction", o.step_fraction);
  o.max_step = r.size("max_step", o.max_step, false);
  o.map_piece = r.size("map_piece", o.map_piece);
  o.reclaim_holes = r.flag("reclaim_holes", o.reclaim_holes);
  o.release_on_grow = r.flag("release_on_grow", o.release_on_grow);
  o.stitch = r.flag("stitch", o.stitch);
  o.stitch_max_parts = r.size("stitch_max_parts", o.stitch_max_parts, false);
  o.stitch_edge_from = r.size("stitch_edge_from", o.stitch_edge_from);
  o.stitch_from = r.size("stitch_from", o.stitch_from);
  o.stitch_top_up = r.flag("stitch_top_up", o.stitch_top_up);
  o.stitch_fragments = r.flag("stitch_fragments", o.stitch_fragments);
  o.stale_alias_cap = r.size("stale_alias_cap", o.stale_alias_cap);
  o.shards = r.size("shards", o.shards);
  o.single_stream = r.flag("single_stream", o.single_stream);
  // Options that shape only the expandable range would be ignored without it: a silent no-op is
  // a misconfiguration the user never hears about.
  if (!o.expandable)
    for (const char* k : expandable_options())
      if (r.given(k))
        throw InvalidArgument(std::string("ArenaPool: option '") + k + "' applies only to expandable=True");
  r.finish();
  return o;
}

SizeClassOptions size_class_options(nb::handle opts) {
  return read_options<SizeClassOptions>(opts, "SizeClassPool", [](OptionReader& r, SizeClassOptions& o) {
    o.classes_per_doubling = r.size("classes_per_doubling", o.classes_per_doubling, false);
    o.max_cached_bytes = r.size("max_cached_bytes", SIZE_MAX);  // 0: cache nothing; None: no cap
    o.shards = r.size("shards", 0);
  });
}

DirectOptions direct_options(nb::handle opts) {
  return read_options<DirectOptions>(opts, "Direct", [](OptionReader&, DirectOptions&) {});
}

}  // namespace poolkeeper::py
