// One real decode through a freshly built libllama, run by build_llama.sh before it
// installs the library: a prefill of 32 tokens in one batch (the batched matmul paths),
// then 4 single-token decodes (the vector paths), every logit checked to be finite.
// A build that uses an instruction this CPU lacks dies here with SIGILL, in a child
// process, instead of in a user's first `swarmkv fanout`.
//
//     smoke_decode MODEL.gguf
//
// Exit 0 and one line on stdout when the decode worked; 1 with a reason on stderr when not.
#include "llama.h"

#include <math.h>
#include <stdio.h>

static int fail(const char * what) {
    fprintf(stderr, "smoke_decode: %s\n", what);
    return 1;
}

static int argmax_checked(const float * logits, int n_vocab, int * best) {
    *best = 0;
    for (int i = 0; i < n_vocab; i++) {
        if (!isfinite(logits[i])) return 0;
        if (logits[i] > logits[*best]) *best = i;
    }
    return 1;
}

int main(int argc, char ** argv) {
    if (argc != 2) return fail("usage: smoke_decode MODEL.gguf");
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();  // extra buffers (repack, AMX) on
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("could not load the model");

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 64;
    cp.n_threads = cp.n_threads_batch = 2;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("could not create a context");

    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_token prompt[32];
    for (int i = 0; i < 32; i++) prompt[i] = (llama_token) ((i * 7 + 3) % n_vocab);
    if (llama_decode(ctx, llama_batch_get_one(prompt, 32)) != 0) return fail("prefill decode failed");

    llama_token next;
    for (int step = 0; step < 4; step++) {
        if (!argmax_checked(llama_get_logits_ith(ctx, -1), n_vocab, &next))
            return fail("non-finite logits");
        if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) return fail("single-token decode failed");
    }
    printf("smoke decode ok: 32-token prefill + 4 decodes, last token %d\n", next);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
