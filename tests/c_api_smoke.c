/* The C ABI (refit/refit.h) driven from C: compiled as C99, called by test_c_api.cpp.
 * One embedded coordinator in this process (world 1), this rank's own tensors registered from
 * malloc'ed memory, bad registrations refused with the tensor named, a missing tensor named
 * by connect, two publications of changing memory verified byte-exact by the coordinator, a
 * moved tensor refused. Returns 0, or 1 with what went wrong in `err`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "refit/refit.h"

#define CHECK(cond, ...)                          \
  do {                                            \
    if (!(cond)) {                                \
      snprintf(err, err_size, __VA_ARGS__);       \
      goto fail;                                  \
    }                                             \
  } while (0)

typedef struct tensor {
  char name[256];
  char dtype[32];
  int64_t shape[8];
  uint32_t ndim;
  uint64_t rows;
  uint64_t bytes;
  unsigned char* data;
} tensor;

static void fill(tensor* t, unsigned seed) {
  /* small bf16 values: sign/exponent of about 0.01, a pseudo-random mantissa */
  for (uint64_t i = 0; i + 1 < t->bytes; i += 2) {
    unsigned v = (unsigned)(i * 2654435761u + seed * 40503u);
    unsigned short bits = (unsigned short)(0x3c00u | ((v >> 7) & 0x7fu));
    t->data[i] = (unsigned char)(bits & 0xffu);
    t->data[i + 1] = (unsigned char)(bits >> 8);
  }
}

static refit_tensor_desc desc_of(const tensor* t) {
  refit_tensor_desc d;
  memset(&d, 0, sizeof(d));
  d.name = t->name;
  d.data = t->data;
  d.bytes = t->bytes;
  d.dtype = t->dtype;
  d.device = "cpu";
  d.global_shape = t->shape;
  d.ndim = t->ndim;
  d.placement = REFIT_SHARD0;
  d.row_begin = 0;
  d.rows = t->rows;
  return d;
}

int refit_c_api_smoke(const char* recipe, char* err, size_t err_size) {
  refit_host* h = NULL;
  refit_status st;
  refit_host_options o;
  refit_publication pub;
  tensor* ts = NULL;
  uint64_t count = 0, i;
  int rc = 1;
  char first_digest[32] = {0}, name[256], digest[32];

  memset(&o, 0, sizeof(o));
  o.config_path = recipe;
  o.coordinator_port = -1;
  CHECK(refit_host_create(&o, &h, &st) == 0, "create: %s", st.text);
  CHECK(st.ok == 1 && st.code[0] == '\0', "create: status not ok");
  CHECK(refit_host_register_rank(h, 0, 1, "cpu:0", &st) == 0, "register_rank: %s", st.text);
  CHECK(refit_host_model_tensor_count(h, &count, &st) == 0 && count > 10, "count: %s", st.text);

  ts = (tensor*)calloc(count, sizeof(tensor));
  for (i = 0; i < count; ++i) {
    uint64_t elements = 1;
    uint32_t d;
    CHECK(refit_host_model_tensor(h, i, ts[i].name, sizeof(ts[i].name), ts[i].dtype,
                                  sizeof(ts[i].dtype), ts[i].shape, &ts[i].ndim, &st) == 0,
          "model_tensor %llu: %s", (unsigned long long)i, st.text);
    for (d = 0; d < ts[i].ndim; ++d)
      elements *= (uint64_t)ts[i].shape[d];
    ts[i].rows = ts[i].ndim ? (uint64_t)ts[i].shape[0] : 1;
    ts[i].bytes = elements * 2; /* bf16 */
    ts[i].data = (unsigned char*)malloc(ts[i].bytes);
    fill(&ts[i], 1);
  }
  CHECK(strcmp(ts[0].dtype, "bfloat16") == 0, "tensor 0 is %s", ts[0].dtype);

  /* Bad registrations, each refused with the tensor's name, nothing recorded. */
  {
    refit_tensor_desc bad = desc_of(&ts[1]);
    bad.dtype = "float32";
    CHECK(refit_host_register_tensor(h, &bad, &st) == -1, "float32 accepted");
    CHECK(strcmp(st.code, "invalid_argument") == 0 && strcmp(st.where, ts[1].name) == 0
            && strstr(st.message, "dtype float32, the model expects bfloat16") != NULL,
          "wrong dtype: %s", st.text);
    bad = desc_of(&ts[1]);
    bad.rows = ts[1].rows - 1;
    CHECK(refit_host_register_tensor(h, &bad, &st) == -1, "short rows accepted");
    CHECK(strstr(st.message, "FSDP2's Shard(0)") != NULL, "short rows: %s", st.text);
    bad = desc_of(&ts[1]);
    bad.placement = 7;
    CHECK(refit_host_register_tensor(h, &bad, &st) == -1 && strstr(st.message, "placement 7"),
          "placement 7: %s", st.text);
  }

  /* Everything but the last tensor: connect names the missing one and can be retried. */
  for (i = 0; i + 1 < count; ++i) {
    refit_tensor_desc d = desc_of(&ts[i]);
    CHECK(refit_host_register_tensor(h, &d, &st) == 0, "register %s: %s", ts[i].name, st.text);
  }
  {
    refit_tensor_desc d = desc_of(&ts[0]);
    CHECK(refit_host_register_tensor(h, &d, &st) == -1 && strstr(st.message, "registered twice"),
          "twice: %s", st.text);
  }
  CHECK(refit_host_connect(h, &st) == -1, "connect without %s succeeded", ts[count - 1].name);
  CHECK(strcmp(st.where, ts[count - 1].name) == 0 && strstr(st.message, "missing tensor"),
        "missing: %s", st.text);
  {
    refit_tensor_desc d = desc_of(&ts[count - 1]);
    CHECK(refit_host_register_tensor(h, &d, &st) == 0, "register last: %s", st.text);
  }
  CHECK(refit_host_connect(h, &st) == 0, "connect: %s", st.text);
  CHECK(refit_host_connected(h) == 1, "not connected");

  /* Publication 1: the coordinator verifies every resident digest against this rank's terms. */
  CHECK(refit_host_publish(h, 1, &pub, &st) == 0, "publish 1: %s", st.text);
  CHECK(pub.model_version == 1 && pub.tensors == count && pub.receipts == 1,
        "publication 1: version %llu, %llu tensors, %u receipts",
        (unsigned long long)pub.model_version, (unsigned long long)pub.tensors, pub.receipts);
  CHECK(refit_host_receipt_checksum(h, 0, 0, name, sizeof(name), first_digest,
                                    sizeof(first_digest), &st) == 0,
        "checksum: %s", st.text);
  CHECK(strcmp(name, "model.embed_tokens.weight") == 0, "first resident is %s", name);

  /* The trainer's step rewrites its memory in place; publication 2 carries the new bytes. */
  for (i = 0; i < count; ++i)
    fill(&ts[i], 2);
  CHECK(refit_host_publish(h, 2, &pub, &st) == 0, "publish 2: %s", st.text);
  CHECK(refit_host_receipt_checksum(h, 0, 0, name, sizeof(name), digest, sizeof(digest), &st) == 0,
        "checksum 2: %s", st.text);
  CHECK(strcmp(digest, first_digest) != 0, "the embedding digest did not change (%s)", digest);

  /* Generation through the coordinator, stamped with the committed version. */
  {
    int32_t prompt[3] = {72, 105, 33};
    uint64_t lengths[1] = {3}, samples = 0, version = 0;
    int32_t toks[8];
    float lps[8];
    refit_sample_info info;
    refit_sampling_params sp;
    refit_rollout_status rs;
    memset(&sp, 0, sizeof(sp));
    sp.n = 2;
    sp.max_tokens = 5;
    sp.temperature = 0.7f;
    sp.top_p = 1.0f;
    sp.seed = 3;
    CHECK(refit_host_generate(h, prompt, lengths, 1, &sp, &samples, &version, &st) == 0,
          "generate: %s", st.text);
    CHECK(samples == 2 && version == 2, "%llu samples of version %llu",
          (unsigned long long)samples, (unsigned long long)version);
    CHECK(refit_host_sample(h, 1, &info, toks, lps, 8, NULL, 0, &st) == 0, "sample: %s", st.text);
    CHECK(info.token_count >= 1 && info.token_count <= 5 && info.model_version == 2
            && info.prompt_token_count == 3 && lps[0] <= 0.0f,
          "sample 1: %llu tokens, version %llu, logprob %f", (unsigned long long)info.token_count,
          (unsigned long long)info.model_version, (double)lps[0]);
    CHECK(refit_host_sample(h, 2, &info, toks, lps, 8, NULL, 0, &st) == -1, "sample 2 exists");
    sp.n = 0;
    CHECK(refit_host_generate(h, prompt, lengths, 1, &sp, &samples, &version, &st) == -1
            && strcmp(st.code, "invalid_argument") == 0,
          "n = 0: %s", st.text);
    CHECK(refit_host_status(h, &rs, &st) == 0 && rs.committed_version == 2 && rs.publishing == 0
            && strcmp(rs.connection, "IDLE") == 0,
          "status: %s (version %llu, %s)", st.text, (unsigned long long)rs.committed_version,
          rs.connection);
    CHECK(refit_host_sleep(h, 1, &rs, &st) == 0 && rs.sleep_level == 1, "sleep: %s", st.text);
    sp.n = 1;
    CHECK(refit_host_generate(h, prompt, lengths, 1, &sp, &samples, &version, &st) == -1
            && strcmp(st.code, "asleep") == 0,
          "generate asleep: %s", st.text);
    CHECK(refit_host_wake(h, 1, 1, &rs, &st) == 0 && rs.weights_awake && rs.kv_cache_awake,
          "wake: %s", st.text);
    CHECK(refit_host_generate(h, prompt, lengths, 1, &sp, &samples, &version, &st) == 0,
          "generate after wake: %s", st.text);
  }

  /* A tensor whose memory moved is refused by name. */
  CHECK(refit_host_check_tensor(h, ts[2].name, ts[2].data, ts[2].bytes, &st) == 0,
        "check unchanged: %s", st.text);
  CHECK(refit_host_check_tensor(h, ts[2].name, ts[3].data, ts[2].bytes, &st) == -1
          && strcmp(st.where, ts[2].name) == 0 && strstr(st.message, "changed since registration"),
        "moved: %s", st.text);

  /* After close, calls fail with a status (no crash, no exception). */
  CHECK(refit_host_close(h, &st) == 0, "close: %s", st.text);
  CHECK(refit_host_publish(h, 3, &pub, &st) == -1 && strcmp(st.code, "invalid_state") == 0,
        "publish after close: %s", st.text);
  CHECK(refit_host_register_tensor(NULL, NULL, &st) == -1 && strcmp(st.code, "invalid_argument") == 0,
        "NULL host: %s", st.text);
  rc = 0;

fail:
  refit_host_destroy(h);
  if (ts) {
    for (i = 0; i < count; ++i)
      free(ts[i].data);
    free(ts);
  }
  return rc;
}
