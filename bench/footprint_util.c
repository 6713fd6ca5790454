/*
 * The pure pieces of `pagekv bench footprint`: filler text, trace windows, the workload's
 * minimum KV and the SVG writer (see footprint.h). No I/O other than the FILE given to
 * the SVG writer, no global state.
 */
#include "footprint.h"

#include "core/core.h"

#include <math.h>
#include <string.h>

void pkv_fp_filler(char *buf, size_t n, uint64_t seed)
{
    /* The shape of bench/bench_tokenizer.c's filler, so its chars/token applies. */
    static const char *const adj[] = {"quick",   "careful", "detailed", "brief",       "thorough",
                                      "initial", "final",   "routine",  "independent", "second"};
    static const char *const noun[] = {"analysis", "review",    "report", "study",
                                       "survey",   "audit",     "test",   "measurement",
                                       "summary",  "evaluation"};
    static const char *const verb[] = {"shows",   "suggests", "confirms",     "indicates",
                                       "reveals", "finds",    "demonstrates", "reports"};
    static const char *const obj[] = {
        "a steady increase in load",        "no change in latency",
        "a small drop in throughput",       "higher memory use than expected",
        "that the cache hit rate improved", "a regression in the nightly build",
        "stable results across all runs",   "errors in about 3 percent of requests"};
    uint64_t st = seed;
    unsigned long long num = (seed % 10000000ull) * 100ull + 1;
    size_t len = 0;
    while (len < n) {
        char s[256];
        int k = snprintf(s, sizeof(s), "Sentence %llu: the %s %s of system %u %s %s. ", num++,
                         adj[pkv_splitmix64(&st) % 10], noun[pkv_splitmix64(&st) % 10],
                         (unsigned)(100 + pkv_splitmix64(&st) % 9900),
                         verb[pkv_splitmix64(&st) % 8], obj[pkv_splitmix64(&st) % 8]);
        size_t take = (size_t)k < n - len ? (size_t)k : n - len;
        memcpy(buf + len, s, take);
        len += take;
    }
    buf[n] = '\0';
}

pkv_fp_window_t pkv_fp_window(const pkv_fp_sample_t *s, size_t n, uint64_t begin, uint64_t end)
{
    pkv_fp_window_t w = {0, 0, 0};
    for (size_t i = 0; i < n; i++) {
        if (s[i].t_ns < begin || s[i].t_ns >= end) continue;
        if (s[i].bytes > w.peak_bytes) w.peak_bytes = s[i].bytes;
        w.last_bytes = s[i].bytes;
        w.n_samples++;
    }
    return w;
}

static uint64_t fp_blocks(uint64_t tokens, uint32_t bt)
{
    return (tokens + bt - 1) / bt;
}

static uint64_t fp_held(const pkv_fp_req_t *r)
{
    uint64_t t = (uint64_t)r->prompt_tokens + r->completion_tokens;
    return t ? t - 1 : 0;
}

uint64_t pkv_fp_kv_min_bytes(const pkv_fp_req_t *r, size_t n, uint32_t block_tokens,
                             uint64_t token_bytes)
{
    if (!block_tokens) return 0;
    uint64_t best = 0;
    for (size_t i = 0; i < n; i++) {
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) seen = r[j].group == r[i].group;
        if (seen) continue;
        /* First request of group r[i].group: find the shared part, then sum. */
        uint64_t shared = UINT64_MAX;
        bool share = false;
        size_t members = 0;
        for (size_t j = i; j < n; j++) {
            if (r[j].group != r[i].group) continue;
            members++;
            share |= r[j].shared_prefix;
            uint64_t c = (uint64_t)r[j].cached_tokens / block_tokens * block_tokens;
            if (c < shared) shared = c;
        }
        if (!share || members < 2) shared = 0;
        uint64_t blocks = shared / block_tokens;
        for (size_t j = i; j < n; j++) {
            if (r[j].group != r[i].group) continue;
            uint64_t held = fp_held(&r[j]);
            blocks += fp_blocks(held > shared ? held - shared : 0, block_tokens);
        }
        if (blocks > best) best = blocks;
    }
    return best * block_tokens * token_bytes;
}

/* ---- SVG ------------------------------------------------------------------------------ */

double pkv_fp_nice_step(double max, int ticks)
{
    if (!(max > 0) || ticks < 1) return 1;
    double raw = max / ticks, p = pow(10, floor(log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

static void svg_text(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '&':
            fputs("&amp;", f);
            break;
        case '<':
            fputs("&lt;", f);
            break;
        case '>':
            fputs("&gt;", f);
            break;
        case '"':
            fputs("&quot;", f);
            break;
        case '\'':
            fputs("&apos;", f);
            break;
        default:
            if ((unsigned char)*s >= 0x20 || *s == '\t') fputc(*s, f);
        }
    }
}

enum { SVG_W = 960, SVG_H = 500, SVG_L = 80, SVG_R = 200, SVG_T = 50, SVG_B = 60 };

int pkv_fp_svg_write(FILE *f, const char *title, const pkv_fp_series_t *s, size_t ns,
                     const pkv_fp_mark_t *m, size_t nm)
{
    double xmax = 0, ymax = 0;
    for (size_t i = 0; i < ns; i++)
        for (size_t j = 0; j < s[i].n; j++) {
            if (isfinite(s[i].x[j]) && s[i].x[j] > xmax) xmax = s[i].x[j];
            if (isfinite(s[i].y[j]) && s[i].y[j] > ymax) ymax = s[i].y[j];
        }
    for (size_t i = 0; i < nm; i++)
        if (isfinite(m[i].x) && m[i].x > xmax) xmax = m[i].x;
    double xstep = pkv_fp_nice_step(xmax > 0 ? xmax : 1, 10);
    double ystep = pkv_fp_nice_step(ymax > 0 ? ymax * 1.05 : 1, 8);
    double xtop = ceil((xmax > 0 ? xmax : 1) / xstep) * xstep;
    double ytop = ceil((ymax > 0 ? ymax * 1.05 : 1) / ystep) * ystep;
    const double pw = SVG_W - SVG_L - SVG_R, ph = SVG_H - SVG_T - SVG_B;
#define PX(v) (SVG_L + (v) / xtop * pw)
#define PY(v) (SVG_T + ph - (v) / ytop * ph)

    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
            "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n"
            "<text x=\"%d\" y=\"24\" font-size=\"15\" font-weight=\"bold\">",
            SVG_W, SVG_H, SVG_W, SVG_H, SVG_W, SVG_H, SVG_L);
    svg_text(f, title);
    fputs("</text>\n", f);
    /* grid and axes */
    for (double v = 0; v <= ytop + ystep / 2; v += ystep) {
        fprintf(f,
                "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                SVG_L, PY(v), SVG_L + pw, PY(v), SVG_L - 6, PY(v) + 4, v);
    }
    for (double v = 0; v <= xtop + xstep / 2; v += xstep) {
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                PX(v), SVG_T, PX(v), SVG_T + ph, PX(v), SVG_T + ph + 18, v);
    }
    fprintf(f,
            "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
            "stroke=\"#333333\"/>\n"
            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">seconds since the server was "
            "ready</text>\n"
            "<text transform=\"translate(20,%.1f) rotate(-90)\" text-anchor=\"middle\">VmRSS / "
            "KV committed (MiB)</text>\n",
            SVG_L, SVG_T, pw, ph, SVG_L + pw / 2, SVG_H - 15, SVG_T + ph / 2);
    /* phase marks */
    for (size_t i = 0; i < nm; i++) {
        if (!isfinite(m[i].x)) continue;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-dasharray=\"2,4\"/>\n"
                "<text transform=\"translate(%.1f,%d) rotate(-90)\" text-anchor=\"end\" "
                "font-size=\"10\" fill=\"%s\">",
                PX(m[i].x), SVG_T, PX(m[i].x), SVG_T + ph, m[i].color, PX(m[i].x) - 3, SVG_T + 4,
                m[i].color);
        svg_text(f, m[i].label);
        fputs("</text>\n", f);
    }
    /* series and legend */
    for (size_t i = 0; i < ns; i++) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"",
                s[i].color, s[i].dashed ? "1.2" : "1.8",
                s[i].dashed ? " stroke-dasharray=\"6,3\"" : "");
        for (size_t j = 0; j < s[i].n; j++) {
            if (!isfinite(s[i].x[j]) || !isfinite(s[i].y[j])) continue;
            fprintf(f, "%s%.1f,%.1f", j ? " " : "", PX(s[i].x[j]), PY(s[i].y[j]));
        }
        fputs("\"/>\n", f);
        double ly = SVG_T + 12 + 20.0 * (double)i;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"2\"%s/>\n<text x=\"%.1f\" y=\"%.1f\">",
                SVG_L + pw + 12, ly, SVG_L + pw + 36, ly, s[i].color,
                s[i].dashed ? " stroke-dasharray=\"6,3\"" : "", SVG_L + pw + 42, ly + 4);
        svg_text(f, s[i].label);
        fputs("</text>\n", f);
    }
    fputs("</svg>\n", f);
#undef PX
#undef PY
    return ferror(f) ? -1 : 0;
}
