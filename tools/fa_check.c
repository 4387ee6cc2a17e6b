// Which attention kernel makes a real model decode faster on this CPU, end to end: the
// fast mode's rule (the table in force: GGML_FA_SHARED_RULE, else the built-in one),
// ggml's kernels forced (GGML_FA_SHARED=off) and ours forced (on). fa_calibrate times
// the op alone; this times what a user runs, the whole model's decode step, so the two
// can be compared and the rule corrected where they disagree (swarmkv_ffi/calibration.py).
//
//     fa_check MODEL.gguf [--cells C] [--npl 1,4,16] [--steps S] [--repeat R] [--threads T]
//
// One prefill of C tokens (sequence 0, one unified KV cache, flash attention on) is
// shared by every measurement, as llama-batched-bench -pps -kvu shares it: for each
// repeat, N and variant (in an order rotated from one repeat to the next), sequence 0
// is copied to N-1 more, S steps of N tokens (one per sequence) are decoded and timed,
// and the new cells are dropped. Prints one JSON object: per N and variant, the median
// decode speed (tokens/s over all N sequences) and every run; progress on stderr.
#include "ggml-cpu.h"
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_NPL 8
#define MAX_REPEAT 32
#define N_VARIANTS 3

static const char * VARIANT[N_VARIANTS] = {"rule", "ggml", "ours"};
static const int MODE[N_VARIANTS] = {GGML_FA_SHARED_AUTO, GGML_FA_SHARED_OFF, GGML_FA_SHARED_ON};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int fail(const char * what) {
    fprintf(stderr, "fa_check: %s\n", what);
    return 1;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double median(const double * v, int n) {
    double s[MAX_REPEAT];
    memcpy(s, v, n * sizeof(double));
    qsort(s, n, sizeof(double), cmp_double);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

// The model's attention head size (the rule's head class): key_length where the model
// names it (Gemma 3: 256, not n_embd / n_head), else n_embd / n_head.
static int head_dim(const struct llama_model * model) {
    char arch[64], key[128], val[32];
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch)) > 0) {
        snprintf(key, sizeof(key), "%s.attention.key_length", arch);
        if (llama_model_meta_val_str(model, key, val, sizeof(val)) > 0) return atoi(val);
    }
    return llama_model_n_embd(model) / llama_model_n_head(model);
}

static void errors_only(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void usage(void) {
    fprintf(stderr, "usage: fa_check MODEL.gguf [--cells C] [--npl 1,4,16] [--steps S] [--repeat R] [--threads T]\n");
}

// A token that is not a control token: decode speed does not depend on which.
static llama_token token_at(int i, int n_vocab) {
    return (llama_token) (1000 + (i * 7919) % (n_vocab - 1000 > 0 ? n_vocab - 1000 : 1)) % n_vocab;
}

// S steps of one token per sequence 0..npl-1 from position `cells`; seconds taken.
static double decode_steps(struct llama_context * ctx, struct llama_batch * batch, int npl, int cells, int steps,
                           int n_vocab) {
    llama_memory_t mem = llama_get_memory(ctx);
    for (int s = 1; s < npl; s++) llama_memory_seq_cp(mem, 0, s, -1, -1);
    const double t0 = now_s();
    for (int step = 0; step < steps; step++) {
        batch->n_tokens = npl;
        for (int s = 0; s < npl; s++) {
            batch->token[s] = token_at(cells + step * npl + s, n_vocab);
            batch->pos[s] = cells + step;
            batch->n_seq_id[s] = 1;
            batch->seq_id[s][0] = s;
            batch->logits[s] = 1;
        }
        if (llama_decode(ctx, *batch) != 0) {
            fprintf(stderr, "fa_check: decode failed at step %d of %d sequences\n", step, npl);
            exit(1);
        }
        llama_synchronize(ctx);
    }
    const double dt = now_s() - t0;
    for (int s = 1; s < npl; s++) llama_memory_seq_rm(mem, s, -1, -1);
    llama_memory_seq_rm(mem, 0, cells, -1);
    return dt;
}

int main(int argc, char ** argv) {
    if (argc < 2 || argv[1][0] == '-') { usage(); return 2; }
    const char * path = argv[1];
    int cells = 2048, steps = 16, repeat = 3, threads = (int) sysconf(_SC_NPROCESSORS_ONLN);
    int npl[MAX_NPL] = {1, 4, 16}, n_npl = 3;
    for (int i = 2; i < argc; i++) {
        const int more = i + 1 < argc;
        if (strcmp(argv[i], "--cells") == 0 && more) cells = atoi(argv[++i]);
        else if (strcmp(argv[i], "--steps") == 0 && more) steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--repeat") == 0 && more) repeat = atoi(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0 && more) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--npl") == 0 && more) {
            n_npl = 0;
            for (char * p = argv[++i]; *p && n_npl < MAX_NPL; ) {
                npl[n_npl++] = (int) strtol(p, &p, 10);
                if (*p == ',') p++;
                else if (*p) { usage(); return 2; }
            }
        } else { usage(); return 2; }
    }
    int max_npl = 0;
    for (int i = 0; i < n_npl; i++) {
        if (npl[i] < 1 || npl[i] > 64) return fail("--npl takes 1 to 64 sequences");
        if (npl[i] > max_npl) max_npl = npl[i];
    }
    if (cells < 64 || steps < 1 || threads < 1 || repeat < 1 || repeat > MAX_REPEAT)
        return fail("--cells >= 64, --steps >= 1, --threads >= 1, --repeat 1..32");

    llama_log_set(errors_only, NULL);
    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(path, llama_model_default_params());
    if (!model) return fail("could not load the model");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (cells + max_npl * (steps + 1) + 256);
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_seq_max = (uint32_t) max_npl;
    cp.kv_unified = true;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.no_perf = true;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("could not create a context");

    struct llama_batch batch = llama_batch_init(cp.n_batch > (uint32_t) max_npl ? (int) cp.n_batch : max_npl, 0, 1);
    fprintf(stderr, "fa_check: prefilling %d cells\n", cells);
    for (int i0 = 0; i0 < cells; i0 += (int) cp.n_batch) {
        const int n = cells - i0 < (int) cp.n_batch ? cells - i0 : (int) cp.n_batch;
        batch.n_tokens = n;
        for (int i = 0; i < n; i++) {
            batch.token[i] = token_at(i0 + i, n_vocab);
            batch.pos[i] = i0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i0 + i == cells - 1;
        }
        if (llama_decode(ctx, batch) != 0) return fail("prefill failed");
    }

    static double tps[MAX_NPL][N_VARIANTS][MAX_REPEAT];
    const double t_start = now_s();
    for (int v = 0; v < N_VARIANTS; v++) {          // a warm-up of each kernel
        ggml_cpu_set_fa_shared(MODE[v]);
        decode_steps(ctx, &batch, 1, cells, 2, n_vocab);
    }
    for (int r = 0; r < repeat; r++) {
        for (int i = 0; i < n_npl; i++) {
            for (int k = 0; k < N_VARIANTS; k++) {
                const int v = (k + r + i) % N_VARIANTS;   // no variant always runs first
                ggml_cpu_set_fa_shared(MODE[v]);
                tps[i][v][r] = npl[i] * steps / decode_steps(ctx, &batch, npl[i], cells, steps, n_vocab);
            }
        }
        fprintf(stderr, "fa_check: repeat %d/%d, %.0f s\n", r + 1, repeat, now_s() - t_start);
    }
    ggml_cpu_set_fa_shared(-1);

    printf("{\"head_dim\": %d, \"n_layer\": %d, \"cells\": %d, \"steps\": %d, \"repeat\": %d, \"threads\": %d, "
           "\"seconds\": %.2f, \"rows\": [", head_dim(model), llama_model_n_layer(model), cells, steps, repeat, threads,
           now_s() - t_start);
    for (int i = 0; i < n_npl; i++) {
        printf("%s\n  {\"npl\": %d", i ? "," : "", npl[i]);
        for (int v = 0; v < N_VARIANTS; v++) {
            printf(", \"%s_tps\": %.2f, \"%s_runs\": [", VARIANT[v], median(tps[i][v], repeat), VARIANT[v]);
            for (int r = 0; r < repeat; r++) printf("%s%.2f", r ? ", " : "", tps[i][v][r]);
            printf("]");
        }
        printf("}");
    }
    printf("\n]}\n");

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
