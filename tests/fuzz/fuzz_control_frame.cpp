// libFuzzer target: untrusted bytes from the runtime child as the parent sees them. The
// frame decoder, the Response parser, the envelope validator and every result conversion
// must answer with a defined error or value, never crash, hang or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "messages/control.pb.h"
#include "runtime/control/framing.hpp"
#include "runtime/control/protocol.hpp"

namespace pb = refit::control::v1;

namespace {

void convert(const pb::Response& rsp) {
  using namespace refit::protocol;
  switch (rsp.result_case()) {
    case pb::Response::kDescribe: (void)from_proto(rsp.describe()); break;
    case pb::Response::kGenerate: (void)from_proto(rsp.generate()); break;
    case pb::Response::kSleep: (void)from_proto(rsp.sleep().state()); break;
    case pb::Response::kWakeUp: (void)from_proto(rsp.wake_up().state()); break;
    case pb::Response::kUpdateWeights: (void)from_proto(rsp.update_weights()); break;
    case pb::Response::kFinishWeightUpdate: (void)from_proto(rsp.finish_weight_update()); break;
    default: break;
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2)
    return 0;
  // First byte picks the command the parent "sent", the rest is what came back.
  auto cmd = static_cast<pb::Command>(data[0] % 12);
  std::uint64_t expected_id = data[1];
  std::string bytes(reinterpret_cast<const char*>(data + 2), size - 2);
  std::string payload;
  auto st = refit::wire::decode_frame(bytes, payload, 1u << 20);
  if (!st)
    payload = bytes; // also exercise the parser on raw bytes
  pb::Response rsp;
  if (!rsp.ParseFromString(payload))
    return 0;
  auto violation = refit::protocol::validate_response(rsp, expected_id, cmd);
  if (!violation && rsp.ok())
    convert(rsp);
  return 0;
}
