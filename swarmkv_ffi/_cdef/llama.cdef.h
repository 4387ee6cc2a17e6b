/* The subset of llama.h (plus the few ggml declarations it needs) that swarmkv_ffi uses.
 * Copied by hand from the pinned header; tests/test_cdef_layout.py compiles these same
 * declarations against the built include/llama.h with cffi's API mode, so the C compiler
 * checks every struct size, field offset and enum value here. */

/* ---- ggml ------------------------------------------------------------------------ */
enum ggml_type {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q6_K = 14, GGML_TYPE_BF16 = 30,
};
enum ggml_log_level {
    GGML_LOG_LEVEL_NONE = 0, GGML_LOG_LEVEL_DEBUG = 1, GGML_LOG_LEVEL_INFO = 2,
    GGML_LOG_LEVEL_WARN = 3, GGML_LOG_LEVEL_ERROR = 4, GGML_LOG_LEVEL_CONT = 5,
};
enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU,
    GGML_BACKEND_DEVICE_TYPE_ACCEL, GGML_BACKEND_DEVICE_TYPE_META,
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
/* A graph node, as llama's eval callback (cb_eval) sees it: swarmkv_ffi.probe reads them. */
enum ggml_op { GGML_OP_NONE = 0 };
struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    enum ggml_op op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[64];
    void * extra;
    char padding[8];
};
size_t       ggml_nbytes(const struct ggml_tensor * tensor);
const char * ggml_op_desc(const struct ggml_tensor * t);
void         ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;

size_t             ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char *       ggml_backend_dev_name(ggml_backend_dev_t device);
const char *       ggml_backend_dev_description(ggml_backend_dev_t device);
void               ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);

/* ---- llama: types ------------------------------------------------------------------ */
struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
typedef struct llama_memory_i * llama_memory_t;
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

enum llama_split_mode { LLAMA_SPLIT_MODE_NONE = 0, LLAMA_SPLIT_MODE_LAYER = 1, LLAMA_SPLIT_MODE_ROW = 2, LLAMA_SPLIT_MODE_TENSOR = 3 };
enum llama_load_mode { LLAMA_LOAD_MODE_AUTO = -1, LLAMA_LOAD_MODE_NONE = 0, LLAMA_LOAD_MODE_MMAP = 1,
                       LLAMA_LOAD_MODE_MLOCK = 2, LLAMA_LOAD_MODE_MMAP_MLOCK = 3, LLAMA_LOAD_MODE_DIRECT_IO = 4 };
enum llama_lazy_mode { LLAMA_LAZY_MODE_OFF = 0, LLAMA_LAZY_MODE_AUTO = 1, LLAMA_LAZY_MODE_ON = 2 };
enum llama_context_type { LLAMA_CONTEXT_TYPE_DEFAULT = 0, LLAMA_CONTEXT_TYPE_MTP = 1 };
enum llama_rope_scaling_type { LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1, LLAMA_ROPE_SCALING_TYPE_NONE = 0,
                               LLAMA_ROPE_SCALING_TYPE_LINEAR = 1, LLAMA_ROPE_SCALING_TYPE_YARN = 2 };
enum llama_pooling_type { LLAMA_POOLING_TYPE_UNSPECIFIED = -1, LLAMA_POOLING_TYPE_NONE = 0, LLAMA_POOLING_TYPE_MEAN = 1,
                          LLAMA_POOLING_TYPE_CLS = 2, LLAMA_POOLING_TYPE_LAST = 3, LLAMA_POOLING_TYPE_RANK = 4 };
enum llama_attention_type { LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1, LLAMA_ATTENTION_TYPE_CAUSAL = 0,
                            LLAMA_ATTENTION_TYPE_NON_CAUSAL = 1 };
enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO = -1, LLAMA_FLASH_ATTN_TYPE_DISABLED = 0, LLAMA_FLASH_ATTN_TYPE_ENABLED = 1,
};

typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    enum llama_load_mode  load_mode;
    enum llama_lazy_mode  lazy_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const struct llama_model_kv_override * kv_overrides;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_host;
    bool no_alloc;
    bool load_mtp;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_context_type      ctx_type;
    enum llama_rope_scaling_type rope_scaling_type;
    enum llama_pooling_type      pooling_type;
    enum llama_attention_type    attention_type;
    enum llama_flash_attn_type   flash_attn_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;
    ggml_backend_sched_eval_callback cb_eval;
    void * cb_eval_user_data;
    enum ggml_type type_k;
    enum ggml_type type_v;
    ggml_abort_callback abort_callback;
    void *              abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    struct llama_sampler_seq_config * samplers;
    size_t                            n_samplers;
    struct llama_context * ctx_other;
};

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

/* ---- llama: functions -------------------------------------------------------------- */
const char * llama_version(void);
struct llama_model_params         llama_model_default_params(void);
struct llama_context_params       llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
void llama_backend_init(void);
void llama_backend_free(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
size_t llama_max_parallel_sequences(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx      (const struct llama_context * ctx);
uint32_t llama_n_ctx_seq  (const struct llama_context * ctx);
uint32_t llama_n_batch    (const struct llama_context * ctx);
uint32_t llama_n_ubatch   (const struct llama_context * ctx);
uint32_t llama_n_seq_max  (const struct llama_context * ctx);
int32_t  llama_n_threads  (struct llama_context * ctx);
/* kernels/ggml/0001-llama-set-batch-invariant.patch (ours, not upstream) */
bool     llama_set_batch_invariant(struct llama_context * ctx, bool on);
void     llama_context_memory_bytes(const struct llama_context * ctx, size_t * context_bytes, size_t * compute_bytes);
llama_memory_t llama_get_memory(const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t  llama_model_n_ctx_train(const struct llama_model * model);
int32_t  llama_model_n_embd     (const struct llama_model * model);
uint32_t llama_model_n_cls_out   (const struct llama_model * model);
int32_t  llama_model_n_layer    (const struct llama_model * model);
int32_t  llama_model_n_head     (const struct llama_model * model);
int32_t  llama_model_n_head_kv  (const struct llama_model * model);
int32_t  llama_model_n_swa      (const struct llama_model * model);
int32_t  llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
int32_t  llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
bool llama_model_has_encoder(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);

int32_t     llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool        llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_sep(const struct llama_vocab * vocab);
bool        llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool        llama_vocab_get_add_eos(const struct llama_vocab * vocab);
bool        llama_vocab_get_add_sep(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
int32_t llama_chat_builtin_templates(const char ** output, size_t len);

void      llama_memory_clear(llama_memory_t mem, bool data);
bool      llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void      llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void      llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);

struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);

struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void   llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void   llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void   llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void   llama_sampler_reset(struct llama_sampler * smpl);
void   llama_sampler_free(struct llama_sampler * smpl);
const char * llama_sampler_name(const struct llama_sampler * smpl);
