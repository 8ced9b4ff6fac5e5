/* refit C API: a plain C ABI over librefit.so (the same host as refit/host.hpp), for
 * bindings (the refit Python package uses it through ctypes) and C programs. Installed as
 * include/refit/refit.h.
 *
 * Every call that can fail takes a refit_status* (may be NULL) and returns 0 on success or
 * -1 on failure; the status then carries refit's error code name ("rank_lost",
 * "invalid_argument", "coordinator_lost", ...), where it happened (a tensor name, a config
 * key, a rank) and the message. No C++ exception crosses this ABI: an unexpected one becomes
 * code "internal". Strings are NUL-terminated UTF-8; texts longer than a field are cut.
 *
 *   refit_host* h = NULL;
 *   refit_status st;
 *   refit_host_options o = {0};
 *   o.config_path = "recipe.yaml";
 *   if (refit_host_create(&o, &h, &st) != 0) { fprintf(stderr, "%s\n", st.text); ... }
 *   refit_host_register_rank(h, rank, world, "cpu:0", &st);
 *   for each parameter: refit_host_register_tensor(h, &desc, &st);
 *   refit_host_connect(h, &st);
 *   refit_publication pub;
 *   refit_host_publish(h, version, &pub, &st);
 *   refit_host_destroy(h);
 *
 * A host is used from one thread at a time. Registered memory must stay valid, at the same
 * address and size, and unchanged while a publish runs (see refit/host.hpp, tensor_spec).
 */
#ifndef REFIT_REFIT_H
#define REFIT_REFIT_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define REFIT_C_API
#else
#define REFIT_C_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct refit_host refit_host;

typedef struct refit_status {
  int ok;              /* 1: success */
  char code[64];       /* "" on success, else refit's error code name */
  char where[512];
  char message[4096];
  char text[4800];     /* "refit.<code> at <where>: <message>" */
} refit_status;

typedef struct refit_host_options {
  const char* config_path;        /* the recipe (model, trainer, publication, serve) */
  const char* coordinator_host;   /* NULL or "": serve.host */
  int coordinator_port;           /* -1: serve.port (0 is a valid override only with embedded) */
  const char* runtime_executable; /* NULL or "": runtime.executable (serve.embedded, rank 0) */
} refit_host_options;

enum refit_placement { REFIT_SHARD0 = 0, REFIT_REPLICATED = 1 };

typedef struct refit_tensor_desc {
  const char* name;          /* canonical HF name or a fused expert parameter */
  const void* data;
  uint64_t bytes;
  const char* dtype;         /* "bfloat16", "float16", "float32" (or bf16, fp16, half, fp32, float) */
  const char* device;        /* "cpu", "cpu:N", "cuda:N"; NULL = "cpu" */
  const int64_t* global_shape;
  uint32_t ndim;
  int placement;             /* enum refit_placement */
  uint64_t row_begin;        /* first global dim-0 row held */
  uint64_t rows;             /* rows held */
} refit_tensor_desc;

typedef struct refit_publication {
  char publication_id[128];
  uint64_t model_version;
  char manifest_fingerprint[80];
  uint64_t tensors;
  uint64_t bytes;
  uint32_t chunks;
  uint32_t trainer_ranks;
  uint32_t tp;
  uint32_t attempts;
  double seconds;
  uint64_t peak_buffer_bytes;
  uint32_t receipts;          /* TP workers that reported; checksums: refit_host_receipt_checksum */
} refit_publication;

typedef struct refit_sampling_params {
  uint32_t n;                    /* samples per prompt (>= 1) */
  uint32_t max_tokens;           /* >= 1 */
  float temperature;             /* 0 = greedy */
  int32_t top_k;                 /* 0 = off */
  float top_p;                   /* (0, 1] */
  uint64_t seed;
  const int32_t* stop_token_ids; /* may be NULL when stop_count is 0 */
  uint32_t stop_count;
  uint32_t max_prompt_length;    /* 0 = no truncation */
} refit_sampling_params;

typedef struct refit_sample_info {
  uint32_t prompt_index;
  uint64_t token_count;          /* generated tokens (= log-probabilities) */
  uint64_t prompt_token_count;   /* after truncation */
  char finish_reason[16];        /* "stop" or "length" */
  int prompt_truncated;
  uint64_t model_version;        /* the committed version that produced it */
} refit_sample_info;

typedef struct refit_rollout_status {
  uint64_t committed_version;
  char connection[16];           /* "IDLE", "INFLIGHT", "BROKEN", "DETACHED" */
  int needs_publication;
  uint32_t sleep_level;
  int weights_awake;
  int kv_cache_awake;
  int publishing;                /* a collective publish is open */
  uint64_t epoch;
  int complete;                  /* every rank joined */
  char last_error[2048];
} refit_rollout_status;

REFIT_C_API const char* refit_version(void);
REFIT_C_API uint32_t refit_wire_protocol_version(void);

REFIT_C_API int refit_host_create(const refit_host_options* options, refit_host** out,
                                  refit_status* status);
/* Closes (leaves the deployment) and frees the host; NULL is allowed. */
REFIT_C_API void refit_host_destroy(refit_host* host);
REFIT_C_API int refit_host_close(refit_host* host, refit_status* status);

REFIT_C_API int refit_host_register_rank(refit_host* host, uint32_t rank, uint32_t world,
                                         const char* device, refit_status* status);
/* The recipe's synthetic weights (job.seed, trainer.lr, trainer.init_scale) from start_step. */
REFIT_C_API int refit_host_register_synthetic(refit_host* host, uint64_t start_step,
                                              refit_status* status);
REFIT_C_API int refit_host_register_tensor(refit_host* host, const refit_tensor_desc* tensor,
                                           refit_status* status);
/* Fails (invalid_argument at the name) when the tensor moved or resized since registration. */
REFIT_C_API int refit_host_check_tensor(refit_host* host, const char* name, const void* data,
                                        uint64_t bytes, refit_status* status);

/* The model's canonical key stream: its length, and tensor i (name, dtype, shape; ndim <= 8). */
REFIT_C_API int refit_host_model_tensor_count(refit_host* host, uint64_t* count,
                                              refit_status* status);
REFIT_C_API int refit_host_model_tensor(refit_host* host, uint64_t index, char* name,
                                        size_t name_size, char* dtype, size_t dtype_size,
                                        int64_t* shape, uint32_t* ndim, refit_status* status);

REFIT_C_API int refit_host_connect(refit_host* host, refit_status* status);
REFIT_C_API int refit_host_step(refit_host* host, uint64_t* step, refit_status* status);
REFIT_C_API int refit_host_publish(refit_host* host, uint64_t model_version,
                                   refit_publication* out, refit_status* status);
/* How many checksums TP worker `tp_rank` reported for the last committed publication. */
REFIT_C_API int refit_host_receipt_checksum_count(refit_host* host, uint32_t tp_rank,
                                                  uint64_t* count, refit_status* status);
/* Checksum i of TP worker `tp_rank` of the last committed publication (publication.verify). */
REFIT_C_API int refit_host_receipt_checksum(refit_host* host, uint32_t tp_rank, uint64_t index,
                                            char* name, size_t name_size, char* digest,
                                            size_t digest_size, refit_status* status);

/* Generation through the coordinator: `prompt_count` prompts of token ids, concatenated in
 * `tokens`, prompt i of `prompt_lengths[i]` tokens. The samples stay in the host until the next
 * generate: read them with refit_host_sample. Refused with "update_open" while a collective
 * publish is open. */
REFIT_C_API int refit_host_generate(refit_host* host, const int32_t* tokens,
                                    const uint64_t* prompt_lengths, uint64_t prompt_count,
                                    const refit_sampling_params* params, uint64_t* sample_count,
                                    uint64_t* model_version, refit_status* status);
/* Sample i of the last generate; token_ids / logprobs take up to `capacity` entries and
 * prompt_token_ids up to `prompt_capacity` (each may be NULL). */
REFIT_C_API int refit_host_sample(refit_host* host, uint64_t index, refit_sample_info* info,
                                  int32_t* token_ids, float* logprobs, uint64_t capacity,
                                  int32_t* prompt_token_ids, uint64_t prompt_capacity,
                                  refit_status* status);
REFIT_C_API int refit_host_sleep(refit_host* host, uint32_t level, refit_rollout_status* out,
                                 refit_status* status);
REFIT_C_API int refit_host_wake(refit_host* host, int weights, int kv_cache,
                                refit_rollout_status* out, refit_status* status);
REFIT_C_API int refit_host_status(refit_host* host, refit_rollout_status* out,
                                  refit_status* status);

REFIT_C_API uint32_t refit_host_rank(const refit_host* host);
REFIT_C_API uint32_t refit_host_world(const refit_host* host);
REFIT_C_API int refit_host_connected(const refit_host* host);

#ifdef __cplusplus
}
#endif

#endif /* REFIT_REFIT_H */
