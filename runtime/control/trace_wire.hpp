// Trace events across the control channel (--trace). The refit-runtime child records into
// its own process-wide recorder (runtime/trace) and appends what it recorded to every
// response (field Response.trace); the parent's proxy feeds them into the parent's recorder
// on the runtime's tracks. Both sides stamp CLOCK_MONOTONIC, so no clock exchange is needed.
#pragma once

#include <cstddef>
#include <string>

#include "messages/control.pb.h"

namespace refit::wire {

// Child: appends the events recorded since the last call to `payload` (a serialized
// Response) as a second serialized Response holding only `trace` (protobuf merges
// concatenated messages), as many as keep the frame within `max_frame_bytes`; those that do
// not fit are dropped and counted in TraceBatch.dropped. Nothing when tracing is off.
void append_trace(std::string& payload, std::size_t max_frame_bytes);

// Parent: the events of `response.trace` into this process's recorder, on tracks
// {runtime_pid, tid}. The child is untrusted: events with an unknown phase, a negative time
// or duration, a tid other than a TP rank or the control server are dropped (and counted),
// names and strings are cut to a bounded length. Returns the events ingested.
std::size_t ingest_trace(const control::v1::Response& response);

} // namespace refit::wire
