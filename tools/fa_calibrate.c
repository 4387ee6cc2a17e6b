// Which flash-attention kernel is faster on this CPU: ggml's stock kernels or the
// shared-prefix kernel of kernels/ggml/0003, at the shapes that decide the default
// mode's choice. Prints the rule table the patch reads (GGML_FA_SHARED_RULE) with every
// measurement behind it, as one JSON object on stdout; progress on stderr.
//
//     fa_calibrate [--threads N] [--repeat R] [--max-cells C]
//
// Shapes: head sizes 64, 128, 256 (with 9/3, 8/2 and 4/1 query/KV heads: SmolLM2-like,
// Llama-like and Gemma-3-like groups); f16 and q8_0 K/V; 1, 2, 4, 16, 64 and 512 query
// tokens (one per bucket of the rule); 128, 512, 2k and 8k cells (up to --max-cells: a
// quicker calibration for short contexts, which the larger sizes then do not decide).
// Two masks, the rule's two mask classes. "prefix": below 64 tokens the fan-out's (every
// row sees the shared cells, then one cell of its own), from 64 on a prefill's (causal
// over the last tokens). "window": the same within a sliding window of 512 cells ending
// at each row's own (Gemma 3's local layers), measured from 2k cells, where most rows no
// longer see cell 0. Each shape runs both kernels alternately, R times after one warm-up
// each, and keeps the fastest of each.
//
// K and V are laid out as llama.cpp's KV cache holds them (one row per cell with every KV
// head side by side; the op sees a strided view per head), and a decode shape (fewer
// than 64 query tokens) runs as one graph over LAYERS such caches, each op on its own,
// the way a model's decode step reads 30 layers of KV that no cache holds: a single op
// on one cache-hot KV flattered the kernel that re-reads it (AVX-512 machines took ours
// at one token where a whole model decoded faster with ggml's). What the op still cannot
// see, tools/fa_check.c measures on a real model afterwards.
//
// The rule for a (head, type, mask, tokens) bucket is the fewest measured cells from
// which the shared-prefix kernel was faster at that size and every larger one; -1 when
// it lost at the largest. Head sizes above 256 (not measured) keep the built-in entries.
// build_llama.sh compiles and runs this after a build; `swarmkv calibrate` re-runs it.
#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define N_HEADS   3
#define N_TYPES   2
#define N_TOKENS  6
#define N_CELLS   4
#define N_MASKS   2    // rows that see cell 0 ("prefix"), rows that do not ("window")
#define N_BUCKETS 6    // the patch's buckets of query tokens: 1, 2-3, 4-15, 16-63, 64-511, >= 512
#define WINDOW    512
#define LAYERS    8    // KV caches a decode shape cycles through (up to COLD_BYTES of them)
#define COLD_BYTES ((size_t) 32 << 20)

static const int HEAD_DIM[N_HEADS]   = {64, 128, 256};
static const int HEAD_Q[N_HEADS]     = {9, 8, 4};
static const int HEAD_KV[N_HEADS]    = {3, 2, 1};
static const char * TYPE_NAME[N_TYPES] = {"f16", "q8_0"};
static const enum ggml_type TYPE[N_TYPES] = {GGML_TYPE_F16, GGML_TYPE_Q8_0};
static const int TOKENS[N_TOKENS]    = {1, 2, 4, 16, 64, 512};
static const int CELLS[N_CELLS]      = {128, 512, 2048, 8192};
static const char * MASK_NAME[N_MASKS] = {"prefix", "window"};

struct timing { double stock_us, shared_us; };

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float uniform(void) {   // in [-1, 1): xorshift64*, the same data on every machine
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (float) ((rng_state * 0x2545F4914F6CDD1Dull) >> 40) / (float) (1 << 23) - 1.0f;
}

static void fill_random(struct ggml_tensor * t) {
    const int64_t n = ggml_nelements(t), row = t->ne[0];
    float * src = malloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) src[i] = uniform();
    if (t->type == GGML_TYPE_F32) {
        memcpy(t->data, src, sizeof(float) * n);
    } else if (t->type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(src, t->data, n);
    } else {
        ggml_quantize_chunk(t->type, src, t->data, 0, n / row, row, NULL);
    }
    free(src);
}

// Fan-out decode (tokens < 64): every row sees cells [0, cells - tokens) and one cell of
// its own at the end. Prefill (tokens >= 64): row i sees [0, cells - tokens + i]. With a
// window, only the cells of those within WINDOW of the row's own position.
static void fill_mask(struct ggml_tensor * mask, int tokens, int cells, int windowed) {
    ggml_fp16_t * m = mask->data;
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    const int shared = cells - tokens;
    for (int i = 0; i < tokens; i++) {
        for (int c = 0; c < cells; c++) {
            const int visible = (tokens < 64 ? (c < shared || c == shared + i) : (c <= shared + i))
                             && (!windowed || c > shared + i - WINDOW);
            m[(int64_t) i * cells + c] = visible ? zero : ninf;
        }
    }
}

// How many layers of KV a shape runs over: one for a prefill (it reuses the KV it reads
// across many query rows), for a decode as many as fit in COLD_BYTES, at most LAYERS.
static int layers_of(int tokens, size_t kv_bytes) {
    if (tokens >= 64) return 1;
    const size_t n = COLD_BYTES / (2 * kv_bytes);
    return n < 1 ? 1 : n > LAYERS ? LAYERS : (int) n;
}

// Both kernels on one shape, alternately; the fastest run of each, in microseconds per op.
static struct timing time_shape(int h, int t, int m, int tokens, int cells, int threads, int repeat) {
    const int dk = HEAD_DIM[h], nq = HEAD_Q[h], nkv = HEAD_KV[h];
    const size_t kv_bytes = ggml_row_size(TYPE[t], (int64_t) dk * nkv) * cells;
    const int layers = layers_of(tokens, kv_bytes);
    const size_t mem = sizeof(float) * (size_t) dk * tokens * nq * 2 * layers + 2 * kv_bytes * layers
                     + sizeof(ggml_fp16_t) * (size_t) tokens * cells + (8 + 8 * layers) * ggml_tensor_overhead()
                     + ggml_graph_overhead() + (1 << 16);
    struct ggml_init_params ip = {mem, NULL, false};
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, dk, tokens, nq, 1);
    struct ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, cells, tokens, 1, 1);
    fill_random(q); fill_mask(mask, tokens, cells, m);
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    for (int l = 0; l < layers; l++) {
        // the cache: a row per cell, the KV heads side by side; the op's view: [dk, cells, nkv]
        struct ggml_tensor * kc = ggml_new_tensor_2d(ctx, TYPE[t], (int64_t) dk * nkv, cells);
        struct ggml_tensor * vc = ggml_new_tensor_2d(ctx, TYPE[t], (int64_t) dk * nkv, cells);
        fill_random(kc); fill_random(vc);
        const size_t head = ggml_row_size(TYPE[t], dk);
        struct ggml_tensor * k = ggml_view_3d(ctx, kc, dk, cells, nkv, kc->nb[1], head, 0);
        struct ggml_tensor * v = ggml_view_3d(ctx, vc, dk, cells, nkv, vc->nb[1], head, 0);
        struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / sqrtf((float) dk), 0.0f, 0.0f);
        ggml_build_forward_expand(graph, out);
    }

    struct ggml_cplan plan = ggml_graph_plan(graph, threads, NULL);   // work size: either kernel
    plan.work_data = malloc(plan.work_size > 0 ? plan.work_size : 1);
    struct timing best = {INFINITY, INFINITY};
    for (int r = -1; r < repeat; r++) {            // r = -1: warm-up
        for (int kernel = 0; kernel < 2; kernel++) {
            ggml_cpu_set_fa_shared(kernel == 0 ? GGML_FA_SHARED_OFF : GGML_FA_SHARED_ON);
            const double t0 = now_us();
            if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
                fprintf(stderr, "fa_calibrate: ggml_graph_compute failed\n");
                exit(1);
            }
            const double us = (now_us() - t0) / layers;
            double * slot = kernel == 0 ? &best.stock_us : &best.shared_us;
            if (r >= 0 && us < *slot) *slot = us;
        }
    }
    ggml_cpu_set_fa_shared(-1);
    free(plan.work_data);
    ggml_free(ctx);
    return best;
}

static int bucket_of(int tokens) {
    return tokens < 2 ? 0 : tokens < 4 ? 1 : tokens < 16 ? 2 : tokens < 64 ? 3 : tokens < 512 ? 4 : 5;
}

// Which (mask, tokens, cells) shapes are measured: a batch's tokens are in the cache; a
// window matters only where the cells reach past it.
static int measured(int m, int tokens, int cells, int max_cells) {
    return cells >= tokens && cells <= max_cells && (m == 0 || cells >= 4 * WINDOW);
}

// The fewest measured cells from which shared won there and at every larger one; -2
// when no size was measured (the entry keeps its built-in value).
static int32_t threshold(const struct timing * row, int m, int tokens, int max_cells) {
    int32_t min_cells = -1, smallest = -1;
    int lost = 0;
    for (int c = N_CELLS - 1; c >= 0; c--) {          // from the largest size down
        if (!measured(m, tokens, CELLS[c], max_cells)) continue;
        smallest = CELLS[c];
        if (!lost && row[c].shared_us < row[c].stock_us) min_cells = CELLS[c];
        else lost = 1;
    }
    if (smallest == -1) return -2;
    if (min_cells != -1 && min_cells == smallest && tokens > 1) min_cells = 0;  // won from the smallest: every size
    return min_cells;
}

int main(int argc, char ** argv) {
    int threads = (int) sysconf(_SC_NPROCESSORS_ONLN), repeat = 3, max_cells = CELLS[N_CELLS - 1];
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (strcmp(argv[i], "--max-cells") == 0 && i + 1 < argc) max_cells = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: fa_calibrate [--threads N] [--repeat R] [--max-cells C]\n");
            return 2;
        }
    }
    if (threads < 1 || repeat < 1 || max_cells < CELLS[1]) {
        fprintf(stderr, "fa_calibrate: --threads and --repeat must be >= 1, --max-cells >= %d\n", CELLS[1]);
        return 2;
    }
    ggml_cpu_init();
    int32_t rule[GGML_FA_SHARED_RULE_LEN];
    ggml_cpu_set_fa_shared_rule(NULL, 0);             // start from the built-in (or env) table
    ggml_cpu_get_fa_shared_rule(rule, GGML_FA_SHARED_RULE_LEN);

    static struct timing timings[N_HEADS][N_TYPES][N_MASKS][N_TOKENS][N_CELLS];
    const double t0 = now_us();
    const int tty = isatty(2);
    int done = 0;
    const int total = N_HEADS * N_TYPES * N_MASKS * N_TOKENS;
    for (int h = 0; h < N_HEADS; h++) {
        for (int t = 0; t < N_TYPES; t++) {
            for (int m = 0; m < N_MASKS; m++) {
                for (int n = 0; n < N_TOKENS; n++) {
                    for (int c = 0; c < N_CELLS; c++) {
                        if (measured(m, TOKENS[n], CELLS[c], max_cells)) {
                            timings[h][t][m][n][c] = time_shape(h, t, m, TOKENS[n], CELLS[c], threads, repeat);
                        }
                    }
                    const int32_t min_cells = threshold(timings[h][t][m][n], m, TOKENS[n], max_cells);
                    if (min_cells >= -1) {
                        rule[((h * N_TYPES + t) * N_MASKS + m) * N_BUCKETS + bucket_of(TOKENS[n])] = min_cells;
                    }
                    ++done;
                    if (tty || done % (N_TOKENS * N_MASKS * N_TYPES) == 0) {   // a log gets a line per head size
                        fprintf(stderr, "%scalibrating the attention kernels: %d/%d shape groups, %.0f s%s",
                                tty ? "\r" : "", done, total, (now_us() - t0) / 1e6, tty ? "" : "\n");
                    }
                }
            }
        }
    }
    if (tty) fprintf(stderr, "\n");

    printf("{\"threads\": %d, \"repeat\": %d, \"max_cells\": %d, \"seconds\": %.2f,\n \"rule\": [",
           threads, repeat, max_cells, (now_us() - t0) / 1e6);
    for (int i = 0; i < GGML_FA_SHARED_RULE_LEN; i++) printf("%s%d", i ? ", " : "", rule[i]);
    printf("],\n \"measured\": [");
    const char * sep = "";
    for (int h = 0; h < N_HEADS; h++)
        for (int t = 0; t < N_TYPES; t++)
            for (int m = 0; m < N_MASKS; m++)
                for (int n = 0; n < N_TOKENS; n++)
                    for (int c = 0; c < N_CELLS; c++) {
                        if (!measured(m, TOKENS[n], CELLS[c], max_cells)) continue;
                        const struct timing * x = &timings[h][t][m][n][c];
                        printf("%s\n  {\"head\": %d, \"kv\": \"%s\", \"mask\": \"%s\", \"tokens\": %d, "
                               "\"cells\": %d, \"stock_us\": %.1f, \"shared_us\": %.1f}",
                               sep, HEAD_DIM[h], TYPE_NAME[t], MASK_NAME[m], TOKENS[n], CELLS[c],
                               x->stock_us, x->shared_us);
                        sep = ",";
                    }
    printf("\n]}\n");
    return 0;
}
