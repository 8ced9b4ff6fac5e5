#include "runtime/journal/journal.hpp"
#include "runtime/journal/wire_format.hpp"

#include <cstring>
#include <type_traits>

#include <caf/actor_companion.hpp>
#include <caf/actor_system.hpp>
#include <caf/deep_to_string.hpp>
#include <caf/local_actor.hpp>
#include <caf/make_actor.hpp>
#include <caf/message_builder.hpp>
#include <caf/meta/annotation.hpp>
#include <caf/sec.hpp>
#include <caf/system_messages.hpp>

#include "actors/interfaces.hpp"
#include "messages/errors.hpp"

namespace refit::journal {

const char* to_string(kind k) {
  switch (k) {
    case kind::unspecified: return "UNSPECIFIED";
    case kind::input_driver: return "INPUT_DRIVER";
    case kind::input_runtime: return "INPUT_RUNTIME";
    case kind::input_process_exit: return "INPUT_PROCESS_EXIT";
    case kind::input_supervisor: return "INPUT_SUPERVISOR";
    case kind::input_rank_report: return "INPUT_RANK_REPORT";
    case kind::input_rank_reply: return "INPUT_RANK_REPLY";
    case kind::input_timer: return "INPUT_TIMER";
    case kind::input_worker: return "INPUT_WORKER";
    case kind::input_exit: return "INPUT_EXIT";
    case kind::internal: return "INTERNAL";
    case kind::value: return "VALUE";
    case kind::output_transition: return "OUTPUT_TRANSITION";
    case kind::output_send: return "OUTPUT_SEND";
    case kind::output_reply: return "OUTPUT_REPLY";
  }
  return "?";
}

bool is_processed(kind k) {
  return (k >= kind::input_driver && k <= kind::input_exit) || k == kind::internal;
}

bool entry::same_as(const entry& o) const {
  return k == o.k && actor == o.actor && type == o.type && peer == o.peer
         && message_id == o.message_id && elements == o.elements;
}


// -------------------------------------------------------------------------------- element codec

namespace {

using detail::reader;
using detail::writer;

// -------------------------------------------------------------------------------- element table

constexpr int max_error_depth = 3; // errors inside error contexts

struct element_type {
  const char* name;
  bool (*match)(const caf::type_erased_tuple&, std::size_t);
  void (*encode)(const caf::type_erased_tuple&, std::size_t, const name_fn&, std::string&);
  // Appends the decoded value to `out`; returns an error text or "".
  std::string (*decode)(reader&, const resolve_fn&, caf::message_builder& out, int depth);
  std::string (*render)(reader&, int depth);
};

const std::vector<element_type>& table();
const element_type* find_type(const std::string& name);

std::string render_error(const caf::error& err) {
  if (!err)
    return "none";
  if (err.category() == caf::atom("refit"))
    return refit::render(err);
  return caf::to_string(err);
}

void encode_error(const caf::error& err, const name_fn& name_of, std::string& out) {
  writer w{out};
  if (!err) {
    w.apply(std::uint8_t{0});
    return;
  }
  w.apply(std::uint8_t{1});
  w.apply(err.code());
  w.apply(err.category());
  std::vector<element> ctx;
  if (!err.context().empty())
    ctx = encode(err.context(), name_of);
  w.varint(ctx.size());
  for (const auto& e : ctx) {
    w.apply(e.type);
    w.apply(e.data);
  }
}

std::string decode_elements(const std::vector<element>& xs, const resolve_fn& resolve,
                            caf::message& out, int depth);

// Reads an error written by encode_error; `resolve` may be empty (render only).
std::string decode_error(reader& r, const resolve_fn& resolve, caf::error& err, int depth) {
  std::uint8_t present = 0;
  r.apply(present);
  if (!r.ok())
    return r.error();
  if (present == 0) {
    err = caf::error{};
    return {};
  }
  if (present != 1)
    return "error flag byte " + std::to_string(present) + " is neither 0 nor 1";
  std::uint8_t code = 0;
  caf::atom_value category{};
  r.apply(code);
  r.apply(category);
  std::size_t n = 0;
  if (!r.ok() || !r.count(n, "error context"))
    return r.error();
  std::vector<element> ctx;
  for (std::size_t i = 0; i < n && r.ok(); ++i) {
    element e;
    r.apply(e.type);
    r.apply(e.data);
    ctx.push_back(std::move(e));
  }
  if (!r.ok())
    return r.error();
  if (depth >= max_error_depth)
    return "errors nested deeper than " + std::to_string(max_error_depth);
  caf::message context;
  if (!ctx.empty()) {
    auto res = decode_elements(ctx, resolve, context, depth + 1);
    if (!res.empty())
      return "context: " + res;
  }
  err = caf::error{code, category, std::move(context)};
  return {};
}

caf::strong_actor_ptr resolve_or_null(const resolve_fn& resolve, const std::string& symbol,
                                      handle_kind k) {
  if (!resolve || symbol == "none")
    return nullptr;
  return resolve(symbol, k);
}

template <class T>
element_type plain(const char* name) {
  return element_type{
    name,
    [](const caf::type_erased_tuple& xs, std::size_t i) { return xs.match_element<T>(i); },
    [](const caf::type_erased_tuple& xs, std::size_t i, const name_fn&, std::string& out) {
      writer w{out};
      w.apply(xs.get_as<T>(i));
    },
    [](reader& r, const resolve_fn&, caf::message_builder& out, int) -> std::string {
      T x{};
      r.apply(x);
      if (!r.ok())
        return r.error();
      out.append(std::move(x));
      return {};
    },
    [](reader& r, int) -> std::string {
      T x{};
      r.apply(x);
      if (!r.ok())
        return "<" + r.error() + ">";
      if constexpr (std::is_same<T, caf::atom_value>::value)
        return "'" + caf::to_string(x) + "'";
      else
        return caf::deep_to_string(x);
    },
  };
}

template <class Handle>
element_type handle_of(const char* name) {
  return element_type{
    name,
    [](const caf::type_erased_tuple& xs, std::size_t i) { return xs.match_element<Handle>(i); },
    [](const caf::type_erased_tuple& xs, std::size_t i, const name_fn& name_of, std::string& out) {
      writer w{out};
      const auto& h = xs.get_as<Handle>(i);
      w.apply(h ? name_of(caf::actor_cast<caf::actor_addr>(h)) : std::string("none"));
    },
    [](reader& r, const resolve_fn& resolve, caf::message_builder& out, int) -> std::string {
      std::string symbol;
      r.apply(symbol);
      if (!r.ok())
        return r.error();
      auto kind = std::is_same<Handle, runtime_proxy_actor>::value ? handle_kind::runtime_proxy
                                                                   : handle_kind::any;
      out.append(caf::actor_cast<Handle>(resolve_or_null(resolve, symbol, kind)));
      return {};
    },
    [](reader& r, int) -> std::string {
      std::string symbol;
      r.apply(symbol);
      return r.ok() ? "<" + symbol + ">" : "<" + r.error() + ">";
    },
  };
}

element_type rank_handles() {
  using V = std::vector<trainer_rank_actor>;
  return element_type{
    "vector<trainer_rank_actor>",
    [](const caf::type_erased_tuple& xs, std::size_t i) { return xs.match_element<V>(i); },
    [](const caf::type_erased_tuple& xs, std::size_t i, const name_fn& name_of, std::string& out) {
      std::vector<std::string> symbols;
      for (const auto& h : xs.get_as<V>(i))
        symbols.push_back(h ? name_of(caf::actor_cast<caf::actor_addr>(h)) : "none");
      writer{out}.apply(symbols);
    },
    [](reader& r, const resolve_fn& resolve, caf::message_builder& out, int) -> std::string {
      std::vector<std::string> symbols;
      r.apply(symbols);
      if (!r.ok())
        return r.error();
      V hs;
      for (const auto& s : symbols)
        hs.push_back(caf::actor_cast<trainer_rank_actor>(
          resolve_or_null(resolve, s, handle_kind::trainer_rank)));
      out.append(std::move(hs));
      return {};
    },
    [](reader& r, int) -> std::string {
      std::vector<std::string> symbols;
      r.apply(symbols);
      if (!r.ok())
        return "<" + r.error() + ">";
      std::string s;
      for (const auto& x : symbols)
        s += (s.empty() ? "" : ", ") + ("<" + x + ">");
      return "[" + s + "]";
    },
  };
}

element_type error_type() {
  return element_type{
    "error",
    [](const caf::type_erased_tuple& xs, std::size_t i) { return xs.match_element<caf::error>(i); },
    [](const caf::type_erased_tuple& xs, std::size_t i, const name_fn& name_of, std::string& out) {
      encode_error(xs.get_as<caf::error>(i), name_of, out);
    },
    [](reader& r, const resolve_fn& resolve, caf::message_builder& out, int depth) -> std::string {
      caf::error err;
      auto res = decode_error(r, resolve, err, depth);
      if (!res.empty())
        return res;
      out.append(std::move(err));
      return {};
    },
    [](reader& r, int depth) -> std::string {
      caf::error err;
      auto res = decode_error(r, {}, err, depth);
      return res.empty() ? render_error(err) : "<" + res + ">";
    },
  };
}

// down_msg / exit_msg: the source's journal name and the reason.
template <class Msg>
element_type system_message(const char* name) {
  return element_type{
    name,
    [](const caf::type_erased_tuple& xs, std::size_t i) { return xs.match_element<Msg>(i); },
    [](const caf::type_erased_tuple& xs, std::size_t i, const name_fn& name_of, std::string& out) {
      const auto& m = xs.get_as<Msg>(i);
      writer{out}.apply(m.source ? name_of(m.source) : std::string("none"));
      encode_error(m.reason, name_of, out);
    },
    [](reader& r, const resolve_fn& resolve, caf::message_builder& out, int depth) -> std::string {
      std::string symbol;
      r.apply(symbol);
      if (!r.ok())
        return r.error();
      Msg m;
      auto res = decode_error(r, resolve, m.reason, depth);
      if (!res.empty())
        return res;
      m.source = caf::actor_cast<caf::actor_addr>(
        resolve_or_null(resolve, symbol, handle_kind::any));
      out.append(std::move(m));
      return {};
    },
    [](reader& r, int depth) -> std::string {
      std::string symbol;
      r.apply(symbol);
      if (!r.ok())
        return "<" + r.error() + ">";
      caf::error err;
      auto res = decode_error(r, {}, err, depth);
      return "{source <" + symbol + ">, " + (res.empty() ? render_error(err) : "<" + res + ">")
             + "}";
    },
  };
}

const std::vector<element_type>& table() {
  static const std::vector<element_type> t = {
    plain<caf::atom_value>("atom"),
    plain<bool>("bool"),
    plain<std::uint32_t>("u32"),
    plain<std::uint64_t>("u64"),
    plain<double>("double"),
    plain<std::string>("string"),
    plain<worker_info>("worker_info"),
    plain<runtime_description>("runtime_description"),
    plain<sampling_params>("sampling_params"),
    plain<generate_request>("generate_request"),
    plain<sample>("sample"),
    plain<generate_result>("generate_result"),
    plain<wake_tags>("wake_tags"),
    plain<transfer_init>("transfer_init"),
    plain<publication_header>("publication_header"),
    plain<tensor_meta>("tensor_meta"),
    plain<buffer_handle>("buffer_handle"),
    plain<weight_chunk>("weight_chunk"),
    plain<chunk_ack>("chunk_ack"),
    plain<finish_request>("finish_request"),
    plain<tensor_checksum>("tensor_checksum"),
    plain<receipt>("receipt"),
    plain<commit_result>("commit_result"),
    plain<phase_id>("phase_id"),
    plain<rank_report>("rank_report"),
    plain<gate_failure>("gate_failure"),
    plain<rank_info>("rank_info"),
    plain<publication_spec>("publication_spec"),
    plain<publication_result>("publication_result"),
    plain<coordinator_status>("coordinator_status"),
    plain<engine_status>("engine_status"),
    plain<supervisor_status>("supervisor_status"),
    plain<score_request>("score_request"),
    plain<score_result>("score_result"),
    plain<std::vector<rank_report>>("vector<rank_report>"),
    plain<std::vector<receipt>>("vector<receipt>"),
    handle_of<runtime_proxy_actor>("runtime_proxy_actor"),
    rank_handles(),
    error_type(),
    system_message<caf::down_msg>("down_msg"),
    system_message<caf::exit_msg>("exit_msg"),
  };
  return t;
}

const element_type* find_type(const std::string& name) {
  for (const auto& t : table())
    if (name == t.name)
      return &t;
  return nullptr;
}

std::string decode_elements(const std::vector<element>& xs, const resolve_fn& resolve,
                            caf::message& out, int depth) {
  caf::message_builder b;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    auto where = "elements[" + std::to_string(i) + "] (" + xs[i].type + ")";
    const auto* t = find_type(xs[i].type);
    if (t == nullptr)
      return where + ": unknown element type";
    reader r{xs[i].data};
    auto res = t->decode(r, resolve, b, depth);
    if (!res.empty())
      return where + ": " + res;
    if (!r.at_end())
      return where + ": " + std::to_string(r.remaining()) + " bytes left after the value";
  }
  out = b.to_message();
  return {};
}

} // namespace

std::vector<element> encode(const caf::type_erased_tuple& xs, const name_fn& name_of) {
  std::vector<element> out;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    element e;
    const element_type* match = nullptr;
    for (const auto& t : table())
      if (t.match(xs, i)) {
        match = &t;
        break;
      }
    if (match != nullptr) {
      e.type = match->name;
      match->encode(xs, i, name_of, e.data);
    } else {
      auto rtti = xs.type(i);
      e.type = std::string("?") + (rtti.second ? rtti.second->name() : "unknown");
      e.data = xs.stringify(i);
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<element> encode(const caf::message& xs, const name_fn& name_of) {
  if (xs.empty())
    return {};
  return encode(xs.content(), name_of);
}

std::string signature(const std::vector<element>& xs) {
  std::string out;
  for (const auto& e : xs) {
    std::string name = e.type;
    if (e.type == "atom") {
      reader r{e.data};
      caf::atom_value a{};
      r.apply(a);
      if (r.ok())
        name = "'" + caf::to_string(a) + "'";
    }
    out += (out.empty() ? "" : ", ") + name;
  }
  return out;
}

std::string decode(const std::vector<element>& xs, const resolve_fn& resolve, caf::message& out) {
  return decode_elements(xs, resolve, out, 0);
}

bool known_element_type(const std::string& type) {
  return find_type(type) != nullptr;
}

std::string render(const std::vector<element>& xs) {
  std::string out;
  for (const auto& e : xs) {
    std::string text;
    if (const auto* t = find_type(e.type)) {
      reader r{e.data};
      text = t->render(r, 0);
      if (r.ok() && !r.at_end())
        text += " <" + std::to_string(r.remaining()) + " trailing bytes>";
    } else {
      text = e.type + " " + e.data;
    }
    out += (out.empty() ? "" : ", ") + text;
  }
  return "(" + out + ")";
}

std::string render(const entry& e) {
  const char* arrow = is_processed(e.k) ? " <- " : " -> ";
  std::string out = "seq " + std::to_string(e.seq) + " " + to_string(e.k) + " " + e.actor;
  if (!e.peer.empty())
    out += arrow + e.peer;
  if (e.message_id != 0) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), " [mid 0x%llx]",
                  static_cast<unsigned long long>(e.message_id));
    out += buf;
  }
  out += " " + e.type + ": " + render(e.elements);
  return out;
}


} // namespace refit::journal
