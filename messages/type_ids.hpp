// refit's atoms and CAF type-ID block. Register with
// `cfg.add_message_types<caf::id_block::refit>()` (runtime/bootstrap does).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <caf/atom.hpp>
#include <caf/type_id.hpp>

#include "messages/errors.hpp"
#include "messages/types.hpp"

CAF_BEGIN_TYPE_ID_BLOCK(refit, caf::first_custom_type_id)

  CAF_ADD_ATOM(refit, refit, describe_atom, "describe")
  CAF_ADD_ATOM(refit, refit, generate_atom, "generate")
  CAF_ADD_ATOM(refit, refit, sleep_atom, "sleep")
  CAF_ADD_ATOM(refit, refit, wake_atom, "wake")
  CAF_ADD_ATOM(refit, refit, init_wt_atom, "init_wt")
  CAF_ADD_ATOM(refit, refit, start_upd_atom, "start_upd")
  CAF_ADD_ATOM(refit, refit, update_atom, "update")
  CAF_ADD_ATOM(refit, refit, finish_upd_atom, "finish_upd")
  CAF_ADD_ATOM(refit, refit, release_atom, "rel_ipc")
  CAF_ADD_ATOM(refit, refit, reset_pc_atom, "reset_pc")
  CAF_ADD_ATOM(refit, refit, shutdown_atom, "shutdown")
  CAF_ADD_ATOM(refit, refit, poison_atom, "poison")
  CAF_ADD_ATOM(refit, refit, status_atom, "status")
  CAF_ADD_ATOM(refit, refit, attach_atom, "attach")
  CAF_ADD_ATOM(refit, refit, io_done_atom, "io_done")
  CAF_ADD_ATOM(refit, refit, reaped_atom, "reaped")
  CAF_ADD_ATOM(refit, refit, restart_atom, "restart")
  CAF_ADD_ATOM(refit, refit, publish_atom, "publish")
  CAF_ADD_ATOM(refit, refit, step_atom, "step")
  CAF_ADD_ATOM(refit, refit, prepare_atom, "prepare")
  CAF_ADD_ATOM(refit, refit, materialize_atom, "material")
  CAF_ADD_ATOM(refit, refit, transferred_atom, "transfered")
  CAF_ADD_ATOM(refit, refit, manifest_atom, "manifest")
  CAF_ADD_ATOM(refit, refit, final_atom, "final")
  CAF_ADD_ATOM(refit, refit, abort_atom, "abort")
  CAF_ADD_ATOM(refit, refit, open_atom, "open")
  CAF_ADD_ATOM(refit, refit, report_atom, "report")
  CAF_ADD_ATOM(refit, refit, deadline_atom, "deadline")
  CAF_ADD_ATOM(refit, refit, done_atom, "done")
  CAF_ADD_ATOM(refit, refit, gave_up_atom, "gave_up")
  CAF_ADD_ATOM(refit, refit, score_atom, "score")

  CAF_ADD_TYPE_ID(refit, (refit::worker_info))
  CAF_ADD_TYPE_ID(refit, (refit::runtime_description))
  CAF_ADD_TYPE_ID(refit, (refit::sampling_params))
  CAF_ADD_TYPE_ID(refit, (refit::generate_request))
  CAF_ADD_TYPE_ID(refit, (refit::sample))
  CAF_ADD_TYPE_ID(refit, (refit::generate_result))
  CAF_ADD_TYPE_ID(refit, (refit::wake_tags))
  CAF_ADD_TYPE_ID(refit, (refit::transfer_init))
  CAF_ADD_TYPE_ID(refit, (refit::publication_header))
  CAF_ADD_TYPE_ID(refit, (refit::tensor_meta))
  CAF_ADD_TYPE_ID(refit, (refit::buffer_handle))
  CAF_ADD_TYPE_ID(refit, (refit::weight_chunk))
  CAF_ADD_TYPE_ID(refit, (refit::chunk_ack))
  CAF_ADD_TYPE_ID(refit, (refit::finish_request))
  CAF_ADD_TYPE_ID(refit, (refit::tensor_checksum))
  CAF_ADD_TYPE_ID(refit, (refit::receipt))
  CAF_ADD_TYPE_ID(refit, (refit::commit_result))
  CAF_ADD_TYPE_ID(refit, (refit::phase_id))
  CAF_ADD_TYPE_ID(refit, (refit::rank_report))
  CAF_ADD_TYPE_ID(refit, (refit::gate_failure))
  CAF_ADD_TYPE_ID(refit, (refit::rank_info))
  CAF_ADD_TYPE_ID(refit, (refit::publication_spec))
  CAF_ADD_TYPE_ID(refit, (refit::publication_result))
  CAF_ADD_TYPE_ID(refit, (refit::coordinator_status))
  CAF_ADD_TYPE_ID(refit, (refit::engine_status))
  CAF_ADD_TYPE_ID(refit, (refit::supervisor_status))
  CAF_ADD_TYPE_ID(refit, (refit::generation_stats))
  CAF_ADD_TYPE_ID(refit, (refit::score_request))
  CAF_ADD_TYPE_ID(refit, (refit::score_result))

CAF_END_TYPE_ID_BLOCK(refit)
