/* Structured outputs on the CPU: a step's grammar masks applied to its logits in one pass (torch's reference
 * takes a table gather and a minimum, each over the whole [rows, vocab]).
 * Row r of the output is logits row r with every token its mask forbids at -inf. word_row[r] is the row of
 * `words` that masks it (packed: bit t % 32 of word t / 32 allows token t; tokens past 32 * num_words are
 * forbidden), or -1 for a row copied as it is. Float bits move as integers: this file builds with
 * -ffast-math, which may assume there are no infinities. Rows [begin, end), so the caller can split them. */
#include <stdint.h>
#include <string.h>

#define NEG_INF_BITS 0xFF800000u

void mask_logits(const uint32_t *logits, const uint32_t *words, const int64_t *word_row, uint32_t *out,
                 int64_t vocab, int64_t num_words, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
        const uint32_t *x = logits + r * vocab;
        uint32_t *o = out + r * vocab;
        if (word_row[r] < 0) {
            memcpy(o, x, (size_t)vocab * sizeof(uint32_t));
            continue;
        }
        const uint32_t *w = words + word_row[r] * num_words;
        const int64_t full = vocab / 32 < num_words ? vocab / 32 : num_words;   /* words wholly inside vocab */
        for (int64_t j = 0; j < full; j++) {
            const uint32_t m = w[j];
            for (int b = 0; b < 32; b++) {
                const uint32_t keep = 0u - ((m >> b) & 1u);   /* all ones if token 32 j + b is allowed */
                o[32 * j + b] = (x[32 * j + b] & keep) | (NEG_INF_BITS & ~keep);
            }
        }
        for (int64_t i = 32 * full; i < vocab; i++) {
            const uint32_t keep = i / 32 < num_words ? 0u - ((w[i / 32] >> (i % 32)) & 1u) : 0u;
            o[i] = (x[i] & keep) | (NEG_INF_BITS & ~keep);
        }
    }
}
