/*
 * The pure pieces of `pagekv bench footprint`: filler text, trace windows, the workload's
 * minimum KV and the SVG writer (see footprint.h). No I/O other than the FILE given to
 * the SVG writer, no global state.
 */
#include "support/footprint.h"

#include "support/filler.h"

#include "pagekv/tokenizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t fp_first_sentence(uint64_t seed)
{
    return (seed % 10000000ull) * 100ull + 1;
}

void pkv_fp_filler(char *buf, size_t n, uint64_t seed)
{
    pkv_filler_write(buf, n, seed, fp_first_sentence(seed));
}

char *pkv_fp_filler_alloc(size_t n, uint64_t seed)
{
    return pkv_filler_alloc(n, seed, fp_first_sentence(seed));
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

/* The plot's scales: data to pixels. */
typedef struct {
    double xtop, ytop, xstep, ystep, pw, ph;
} svg_axes_t;

static double svg_px(const svg_axes_t *ax, double v)
{
    return SVG_L + v / ax->xtop * ax->pw;
}

static double svg_py(const svg_axes_t *ax, double v)
{
    return SVG_T + ax->ph - v / ax->ytop * ax->ph;
}

static svg_axes_t svg_axes(const pkv_fp_series_t *s, size_t ns, const pkv_fp_mark_t *m, size_t nm)
{
    double xmax = 0, ymax = 0;
    for (size_t i = 0; i < ns; i++)
        for (size_t j = 0; j < s[i].n; j++) {
            if (isfinite(s[i].x[j]) && s[i].x[j] > xmax) xmax = s[i].x[j];
            if (isfinite(s[i].y[j]) && s[i].y[j] > ymax) ymax = s[i].y[j];
        }
    for (size_t i = 0; i < nm; i++)
        if (isfinite(m[i].x) && m[i].x > xmax) xmax = m[i].x;
    svg_axes_t ax;
    ax.xstep = pkv_fp_nice_step(xmax > 0 ? xmax : 1, 10);
    ax.ystep = pkv_fp_nice_step(ymax > 0 ? ymax * 1.05 : 1, 8);
    ax.xtop = ceil((xmax > 0 ? xmax : 1) / ax.xstep) * ax.xstep;
    ax.ytop = ceil((ymax > 0 ? ymax * 1.05 : 1) / ax.ystep) * ax.ystep;
    ax.pw = SVG_W - SVG_L - SVG_R;
    ax.ph = SVG_H - SVG_T - SVG_B;
    return ax;
}

/* Header, title, grid, axes and their labels. */
static void svg_frame(FILE *f, const char *title, const char *xlabel, const char *ylabel,
                      const svg_axes_t *ax)
{
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
            "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n"
            "<text x=\"%d\" y=\"24\" font-size=\"15\" font-weight=\"bold\">",
            SVG_W, SVG_H, SVG_W, SVG_H, SVG_W, SVG_H, SVG_L);
    svg_text(f, title);
    fputs("</text>\n", f);
    for (double v = 0; v <= ax->ytop + ax->ystep / 2; v += ax->ystep) {
        fprintf(f,
                "<line x1=\"%d\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                SVG_L, svg_py(ax, v), SVG_L + ax->pw, svg_py(ax, v), SVG_L - 6, svg_py(ax, v) + 4,
                v);
    }
    for (double v = 0; v <= ax->xtop + ax->xstep / 2; v += ax->xstep) {
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eeeeee\"/>\n"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                svg_px(ax, v), SVG_T, svg_px(ax, v), SVG_T + ax->ph, svg_px(ax, v),
                SVG_T + ax->ph + 18, v);
    }
    fprintf(f,
            "<rect x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
            "stroke=\"#333333\"/>\n"
            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">",
            SVG_L, SVG_T, ax->pw, ax->ph, SVG_L + ax->pw / 2, SVG_H - 15);
    svg_text(f, xlabel);
    fprintf(f,
            "</text>\n<text transform=\"translate(20,%.1f) rotate(-90)\" "
            "text-anchor=\"middle\">",
            SVG_T + ax->ph / 2);
    svg_text(f, ylabel);
    fputs("</text>\n", f);
}

/* Vertical phase marks (those at a non-finite x are skipped). */
static void svg_marks(FILE *f, const svg_axes_t *ax, const pkv_fp_mark_t *m, size_t nm)
{
    for (size_t i = 0; i < nm; i++) {
        if (!isfinite(m[i].x)) continue;
        double x = svg_px(ax, m[i].x);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-dasharray=\"2,4\"/>\n"
                "<text transform=\"translate(%.1f,%d) rotate(-90)\" text-anchor=\"end\" "
                "font-size=\"10\" fill=\"%s\">",
                x, SVG_T, x, SVG_T + ax->ph, m[i].color, x - 3, SVG_T + 4, m[i].color);
        svg_text(f, m[i].label);
        fputs("</text>\n", f);
    }
}

/* One polyline per series (non-finite points skipped) and its legend entry. */
static void svg_series(FILE *f, const svg_axes_t *ax, const pkv_fp_series_t *s, size_t ns)
{
    for (size_t i = 0; i < ns; i++) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"",
                s[i].color, s[i].dashed ? "1.2" : "1.8",
                s[i].dashed ? " stroke-dasharray=\"6,3\"" : "");
        for (size_t j = 0; j < s[i].n; j++) {
            if (!isfinite(s[i].x[j]) || !isfinite(s[i].y[j])) continue;
            fprintf(f, "%s%.1f,%.1f", j ? " " : "", svg_px(ax, s[i].x[j]), svg_py(ax, s[i].y[j]));
        }
        fputs("\"/>\n", f);
        double ly = SVG_T + 12 + 20.0 * (double)i, lx = SVG_L + ax->pw;
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                "stroke-width=\"2\"%s/>\n<text x=\"%.1f\" y=\"%.1f\">",
                lx + 12, ly, lx + 36, ly, s[i].color,
                s[i].dashed ? " stroke-dasharray=\"6,3\"" : "", lx + 42, ly + 4);
        svg_text(f, s[i].label);
        fputs("</text>\n", f);
    }
}

int pkv_fp_svg_write(FILE *f, const char *title, const pkv_fp_series_t *s, size_t ns,
                     const pkv_fp_mark_t *m, size_t nm)
{
    return pkv_fp_svg_plot(f, title, "seconds since the server was ready",
                           "VmRSS / KV committed (MiB)", s, ns, m, nm);
}

int pkv_fp_svg_plot(FILE *f, const char *title, const char *xlabel, const char *ylabel,
                    const pkv_fp_series_t *s, size_t ns, const pkv_fp_mark_t *m, size_t nm)
{
    svg_axes_t ax = svg_axes(s, ns, m, nm);
    svg_frame(f, title, xlabel, ylabel, &ax);
    svg_marks(f, &ax, m, nm);
    svg_series(f, &ax, s, ns);
    fputs("</svg>\n", f);
    return ferror(f) ? -1 : 0;
}

double pkv_fp_chars_per_token(void)
{
    pkv_tok_t *tok = NULL;
    char *s = pkv_fp_filler_alloc(16000, 1);
    int32_t *ids = NULL;
    size_t n = 0;
    double cpt = 4.0;
    if (s && pkv_tok_create_builtin(&tok) == PKV_OK &&
        pkv_tok_encode_alloc(tok, s, 16000, false, &ids, &n) == PKV_OK && n)
        cpt = 16000.0 / (double)n;
    free(ids);
    free(s);
    pkv_tok_destroy(tok);
    return cpt;
}
