/*
 * Compiled inner loops of treedecomp: greedy min-fill on sparse graphs and
 * the elimination tree.  Optional: the package works without this module,
 * and the Python code in treedecomp/_elimination.py is the reference.
 *
 * min_fill is the set phase of treedecomp._elimination.eliminate_min_fill written
 * in C: the same keys (fill-in times weight, degree, rank, vertex), the same
 * lazy-deletion heap, the same incremental triangle counts, the same stop,
 * abort and tail rules, and the same hand-over to the bitset phase once a
 * vertex of degree `dense_degree` is next.  It therefore makes exactly the
 * choices the Python code makes (tests/treedecomp/test_td_compiled.py checks
 * this on random graphs); it only spends less time per step, which on
 * neural-network op graphs (tens of thousands of vertices of degree 3-5) is
 * where all the time goes.
 *
 * build_decomposition is treedecomp._elimination.build_decomposition: the
 * same bags, merged the same way, and the same tree edges in the same order.
 *
 * Neighbourhoods are sorted int arrays: membership, intersection and
 * difference are merges (or binary searches when one side is much smaller),
 * and insertion or removal moves at most one neighbourhood's worth of ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int *a;
    int n;
    int cap;
} IntVec;

typedef struct {
    double key;
    long long rank;
    int degree;
    int v;
} Entry;

typedef struct {
    Entry *e;
    Py_ssize_t n;
    Py_ssize_t cap;
} Heap;

/* ------------------------------------------------------------ sorted arrays */

static int vec_reserve(IntVec *x, int need) {
    if (need <= x->cap) return 0;
    int cap = x->cap ? x->cap : 4;
    while (cap < need) cap *= 2;
    int *a = (int *)realloc(x->a, (size_t)cap * sizeof(int));
    if (!a) return -1;
    x->a = a;
    x->cap = cap;
    return 0;
}

/* first index i with a[i] >= key */
static int lower_bound(const int *a, int n, int key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (a[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int vec_contains(const IntVec *x, int key) {
    int i = lower_bound(x->a, x->n, key);
    return i < x->n && x->a[i] == key;
}

static int vec_insert(IntVec *x, int key) {
    int i = lower_bound(x->a, x->n, key);
    if (i < x->n && x->a[i] == key) return 0;
    if (vec_reserve(x, x->n + 1) < 0) return -1;
    memmove(x->a + i + 1, x->a + i, (size_t)(x->n - i) * sizeof(int));
    x->a[i] = key;
    x->n++;
    return 0;
}

static void vec_remove(IntVec *x, int key) {
    int i = lower_bound(x->a, x->n, key);
    if (i < x->n && x->a[i] == key) {
        memmove(x->a + i, x->a + i + 1, (size_t)(x->n - i - 1) * sizeof(int));
        x->n--;
    }
}

/* Common elements of two sorted arrays, written to out (if not NULL); returns
   their number.  Binary searches from the smaller side when the sizes differ
   a lot (a hub vertex beside a small neighbourhood), a merge otherwise. */
static int intersect(const int *a, int na, const int *b, int nb, int *out) {
    if (na > nb) {
        const int *t = a; a = b; b = t;
        int tn = na; na = nb; nb = tn;
    }
    int c = 0;
    if (na * 16 < nb) {
        int lo = 0;
        for (int i = 0; i < na; i++) {
            int j = lo + lower_bound(b + lo, nb - lo, a[i]);
            if (j < nb && b[j] == a[i]) {
                if (out) out[c] = a[i];
                c++;
                lo = j + 1;
            } else {
                lo = j;
            }
        }
        return c;
    }
    int i = 0, j = 0;
    while (i < na && j < nb) {
        if (a[i] < b[j]) i++;
        else if (a[i] > b[j]) j++;
        else {
            if (out) out[c] = a[i];
            c++;
            i++;
            j++;
        }
    }
    return c;
}

/* ------------------------------------------------------------------- heap */

static int entry_less(const Entry *x, const Entry *y) {
    if (x->key != y->key) return x->key < y->key;
    if (x->degree != y->degree) return x->degree < y->degree;
    if (x->rank != y->rank) return x->rank < y->rank;
    return x->v < y->v;
}

static int heap_push(Heap *h, Entry e) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 64;
        Entry *ne = (Entry *)realloc(h->e, (size_t)cap * sizeof(Entry));
        if (!ne) return -1;
        h->e = ne;
        h->cap = cap;
    }
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) >> 1;
        if (!entry_less(&e, &h->e[p])) break;
        h->e[i] = h->e[p];
        i = p;
    }
    h->e[i] = e;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->e[0];
    Entry last = h->e[--h->n];
    Py_ssize_t i = 0, n = h->n;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && entry_less(&h->e[c + 1], &h->e[c])) c++;
        if (!entry_less(&h->e[c], &last)) break;
        h->e[i] = h->e[c];
        i = c;
    }
    if (n > 0) h->e[i] = last;
    return top;
}

/* ----------------------------------------------------------------- engine */

typedef struct {
    Py_ssize_t n;
    IntVec *adj;
    long long *t;
    double *weight;
    long long *rank;
    char *alive;
    int *mark;     /* stamp per vertex: "already in changed" */
    int *changed;  /* vertices whose key may have changed this step */
    int *missing;  /* neighbours of v not yet adjacent to a */
    int *common;   /* common neighbours of a fill edge's ends */
    Heap heap;
} Engine;

static void engine_free(Engine *g) {
    if (g->adj) {
        for (Py_ssize_t v = 0; v < g->n; v++) free(g->adj[v].a);
    }
    free(g->adj);
    free(g->t);
    free(g->weight);
    free(g->rank);
    free(g->alive);
    free(g->mark);
    free(g->changed);
    free(g->missing);
    free(g->common);
    free(g->heap.e);
}

static double key_of(const Engine *g, int u) {
    long long d = g->adj[u].n;
    long long f = d * (d - 1) / 2 - g->t[u];
    return (double)f * g->weight[u];
}

static int cmp_int(const void *x, const void *y) {
    int a = *(const int *)x, b = *(const int *)y;
    return (a > b) - (a < b);
}

/* Read adj (a sequence of iterables of ints in 0..n-1, or of vertex labels
   when index, a dict from label to int, is given), rank and weight.
   Self-loops and repeated neighbours are dropped. */
static int engine_load(Engine *g, PyObject *adj, PyObject *index, PyObject *rank, PyObject *weight) {
    Py_ssize_t n = PySequence_Size(adj);
    if (n < 0) return -1;
    g->n = n;
    size_t m = n > 0 ? (size_t)n : 1;
    g->adj = (IntVec *)calloc(m, sizeof(IntVec));
    g->t = (long long *)calloc(m, sizeof(long long));
    g->weight = (double *)malloc(m * sizeof(double));
    g->rank = (long long *)malloc(m * sizeof(long long));
    g->alive = (char *)malloc(m);
    g->mark = (int *)calloc(m, sizeof(int));
    g->changed = (int *)malloc(m * sizeof(int));
    g->missing = (int *)malloc(m * sizeof(int));
    g->common = (int *)malloc(m * sizeof(int));
    if (!g->adj || !g->t || !g->weight || !g->rank || !g->alive || !g->mark || !g->changed || !g->missing ||
        !g->common) {
        PyErr_NoMemory();
        return -1;
    }
    memset(g->alive, 1, m);
    for (Py_ssize_t v = 0; v < n; v++) {
        PyObject *nbrs = PySequence_GetItem(adj, v);
        if (!nbrs) return -1;
        Py_ssize_t len = PyObject_Size(nbrs);
        if (len < 0 || len > INT_MAX - 1) {
            Py_DECREF(nbrs);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "neighbourhood too large");
            return -1;
        }
        if (vec_reserve(&g->adj[v], (int)len + 1) < 0) {
            Py_DECREF(nbrs);
            PyErr_NoMemory();
            return -1;
        }
        PyObject *it = PyObject_GetIter(nbrs);
        Py_DECREF(nbrs);
        if (!it) return -1;
        PyObject *item;
        int k = 0;
        while ((item = PyIter_Next(it)) != NULL) {
            if (index != Py_None) {
                PyObject *i = PyDict_GetItemWithError(index, item); /* borrowed */
                if (!i) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, item);
                    Py_DECREF(item);
                    break;
                }
                Py_INCREF(i);
                Py_DECREF(item);
                item = i;
            }
            long u = PyLong_AsLong(item);
            Py_DECREF(item);
            if (u == -1 && PyErr_Occurred()) break;
            if (u < 0 || u >= n) {
                PyErr_Format(PyExc_ValueError, "neighbour %ld of vertex %zd is not a vertex index", u, v);
                break;
            }
            if (u != v && k < len) g->adj[v].a[k++] = (int)u;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) return -1;
        qsort(g->adj[v].a, (size_t)k, sizeof(int), cmp_int);
        int w = 0; /* drop duplicates */
        for (int i = 0; i < k; i++) {
            if (w == 0 || g->adj[v].a[w - 1] != g->adj[v].a[i]) g->adj[v].a[w++] = g->adj[v].a[i];
        }
        g->adj[v].n = w;
    }
    for (Py_ssize_t v = 0; v < n; v++) {
        if (rank == Py_None) {
            g->rank[v] = v;
        } else {
            PyObject *r = PySequence_GetItem(rank, v);
            if (!r) return -1;
            g->rank[v] = PyLong_AsLongLong(r);
            Py_DECREF(r);
            if (g->rank[v] == -1 && PyErr_Occurred()) return -1;
        }
        if (weight == Py_None) {
            g->weight[v] = 1.0;
        } else {
            PyObject *w = PySequence_GetItem(weight, v);
            if (!w) return -1;
            g->weight[v] = PyFloat_AsDouble(w);
            Py_DECREF(w);
            if (g->weight[v] == -1.0 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

/* 1 if stop() says so, 0 if not, -1 on an exception. */
static int ask_stop(PyObject *stop) {
    PyObject *r = PyObject_CallNoArgs(stop);
    if (!r) return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

/* Triangle counts t[v] (edges among v's neighbours); 1 if stopped, -1 on error. */
static int count_triangles(Engine *g, PyObject *stop, int every) {
    for (Py_ssize_t u = 0; u < g->n; u++) {
        if (stop != Py_None && u % every == every - 1) {
            int s = ask_stop(stop);
            if (s) return s;
        }
        IntVec *au = &g->adj[u];
        for (int i = 0; i < au->n; i++) {
            int w = au->a[i];
            if (w > u) {
                int c = intersect(au->a, au->n, g->adj[w].a, g->adj[w].n, NULL);
                g->t[u] += c;
                g->t[w] += c;
            }
        }
    }
    for (Py_ssize_t u = 0; u < g->n; u++) g->t[u] /= 2;
    return 0;
}

static PyObject *int_list(const int *a, int n) {
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLong(a[i]);
        if (!x) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, x);
    }
    return list;
}

PyDoc_STRVAR(min_fill_doc,
"min_fill(adj, index, rank, weight, abort_at, stop, stop_every, count_stop_every, dense_degree, dense_max)\n"
"--\n\n"
"Set phase of greedy min-fill; see treedecomp._elimination.eliminate_min_fill.\n"
"adj[v] holds v's neighbours: ints, or labels looked up in the dict index.\n\n"
"Returns (status, order, higher, width, alive, adj, t): status is 'done', 'stop',\n"
"'abort' or 'dense'; higher[v] is None for vertices not eliminated; alive lists\n"
"the vertices not eliminated, in increasing order; adj (lists)\n"
"and t (triangle counts) describe the graph left, and are None unless status\n"
"is 'dense' (the bitset phase continues from them).");

static PyObject *min_fill(PyObject *self, PyObject *args) {
    PyObject *adj, *index, *rank, *weight, *stop;
    long long abort_at;
    int stop_every, count_every, dense_degree;
    Py_ssize_t dense_max;
    if (!PyArg_ParseTuple(args, "OOOOLOiiin", &adj, &index, &rank, &weight, &abort_at, &stop, &stop_every,
                          &count_every, &dense_degree, &dense_max))
        return NULL;
    if (index != Py_None && !PyDict_Check(index)) {
        PyErr_SetString(PyExc_TypeError, "index must be a dict or None");
        return NULL;
    }
    if (stop_every < 1 || count_every < 1) {
        PyErr_SetString(PyExc_ValueError, "stop intervals must be positive");
        return NULL;
    }
    Engine g;
    memset(&g, 0, sizeof g);
    PyObject *order = NULL, *higher = NULL, *result = NULL;
    const char *status = "done";
    long long width = -1;
    if (engine_load(&g, adj, index, rank, weight) < 0) goto fail;
    Py_ssize_t n = g.n, remaining = n;
    order = PyList_New(0);
    higher = PyList_New(n);
    if (!order || !higher) goto fail;
    for (Py_ssize_t v = 0; v < n; v++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(higher, v, Py_None);
    }
    int counted = count_triangles(&g, stop, count_every);
    if (counted < 0) goto fail;
    if (counted > 0) {
        status = "stop";
        goto finish;
    }
    for (Py_ssize_t v = 0; v < n; v++) {
        Entry e = {key_of(&g, (int)v), g.rank[v], g.adj[v].n, (int)v};
        if (heap_push(&g.heap, e) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    long long steps = 0;
    int stamp = 0;
    while (g.heap.n > 0) {
        if (remaining - 1 <= width) break;
        Entry e = heap_pop(&g.heap);
        int v = e.v;
        long long d = e.degree;
        if (!g.alive[v] || d != g.adj[v].n) continue; /* stale */
        long long f = d * (d - 1) / 2 - g.t[v];
        if (e.key != (double)f * g.weight[v]) continue; /* stale */
        if (d >= dense_degree && remaining <= dense_max) {
            heap_push(&g.heap, e); /* cannot fail: the slot was just freed */
            status = "dense";
            break;
        }
        steps++;
        if (stop != Py_None && steps % stop_every == 0) {
            int s = ask_stop(stop);
            if (s < 0) goto fail;
            if (s) {
                status = "stop";
                break;
            }
        }
        g.alive[v] = 0;
        remaining--;
        if (d > width) {
            width = d;
            if (abort_at >= 0 && d >= abort_at) {
                status = "abort";
                break;
            }
        }
        /* take v's neighbourhood as its own array: v leaves the graph */
        IntVec Nv = g.adj[v];
        g.adj[v].a = NULL;
        g.adj[v].n = g.adj[v].cap = 0;
        PyObject *vo = PyLong_FromLong(v);
        PyObject *hv = int_list(Nv.a, Nv.n);
        if (!vo || !hv || PyList_Append(order, vo) < 0) {
            Py_XDECREF(vo);
            Py_XDECREF(hv);
            free(Nv.a);
            goto fail;
        }
        Py_DECREF(vo);
        PyList_SetItem(higher, v, hv); /* steals hv */
        stamp++;
        int nchanged = 0;
        for (int i = 0; i < Nv.n; i++) {
            int u = Nv.a[i];
            g.mark[u] = stamp;
            g.changed[nchanged++] = u;
            vec_remove(&g.adj[u], v);
            if (f == 0) g.t[u] -= d - 1;
            else g.t[u] -= intersect(g.adj[u].a, g.adj[u].n, Nv.a, Nv.n, NULL);
        }
        if (d > 1 && f > 0) {
            for (int i = 0; i < Nv.n; i++) {
                int a = Nv.a[i];
                /* neighbours of v not yet adjacent to a (nor a itself) */
                int nm = 0;
                for (int j = 0; j < Nv.n; j++) {
                    int b = Nv.a[j];
                    if (b != a && !vec_contains(&g.adj[a], b)) g.missing[nm++] = b;
                }
                for (int j = 0; j < nm; j++) {
                    int b = g.missing[j];
                    int c = intersect(g.adj[a].a, g.adj[a].n, g.adj[b].a, g.adj[b].n, g.common);
                    for (int k = 0; k < c; k++) {
                        int w = g.common[k];
                        g.t[w] += 1;
                        if (g.mark[w] != stamp) {
                            g.mark[w] = stamp;
                            g.changed[nchanged++] = w;
                        }
                    }
                    g.t[a] += c;
                    g.t[b] += c;
                    if (vec_insert(&g.adj[a], b) < 0 || vec_insert(&g.adj[b], a) < 0) {
                        free(Nv.a);
                        PyErr_NoMemory();
                        goto fail;
                    }
                }
            }
        }
        free(Nv.a);
        for (int i = 0; i < nchanged; i++) {
            int u = g.changed[i];
            Entry ne = {key_of(&g, u), g.rank[u], g.adj[u].n, u};
            if (heap_push(&g.heap, ne) < 0) {
                PyErr_NoMemory();
                goto fail;
            }
        }
    }
finish:;
    PyObject *alive = PyList_New(0);
    if (!alive) goto fail;
    for (Py_ssize_t v = 0; v < n; v++) {
        if (!g.alive[v]) continue;
        PyObject *x = PyLong_FromSsize_t(v);
        if (!x || PyList_Append(alive, x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(alive);
            goto fail;
        }
        Py_DECREF(x);
    }
    PyObject *adj_out = Py_None, *t_out = Py_None;
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    if (strcmp(status, "dense") == 0) {
        Py_DECREF(adj_out);
        Py_DECREF(t_out);
        adj_out = PyList_New(n);
        t_out = PyList_New(n);
        if (!adj_out || !t_out) {
            Py_XDECREF(adj_out);
            Py_XDECREF(t_out);
            Py_DECREF(alive);
            goto fail;
        }
        for (Py_ssize_t v = 0; v < n; v++) {
            PyObject *nb = int_list(g.adj[v].a, g.adj[v].n);
            PyObject *tv = PyLong_FromLongLong(g.t[v]);
            if (!nb || !tv) {
                Py_XDECREF(nb);
                Py_XDECREF(tv);
                Py_DECREF(adj_out);
                Py_DECREF(t_out);
                Py_DECREF(alive);
                goto fail;
            }
            PyList_SET_ITEM(adj_out, v, nb);
            PyList_SET_ITEM(t_out, v, tv);
        }
    }
    result = Py_BuildValue("(sNNLNNN)", status, order, higher, width, alive, adj_out, t_out);
    order = higher = NULL; /* references passed to result (or released by it on failure) */
fail:
    Py_XDECREF(order);
    Py_XDECREF(higher);
    engine_free(&g);
    return result;
}

/* -------------------------------------------------------- elimination tree */

PyDoc_STRVAR(build_doc,
"build_decomposition(nodes, order, higher, tail)\n"
"--\n\n"
"(bags, edges) of treedecomp._elimination.build_decomposition: bags as frozensets\n"
"of labels from nodes, tree edges as pairs of bag indices.");

/* Items of a list or tuple of ints, read into out (room for n ints). */
static int read_ints(PyObject *seq, int *out, Py_ssize_t n, Py_ssize_t limit) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long x = PyLong_AsLong(items[i]);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (x < 0 || x >= limit) {
            PyErr_Format(PyExc_ValueError, "vertex index %ld out of range", x);
            return -1;
        }
        out[i] = (int)x;
    }
    return 0;
}

/* Append to bags the frozenset of the labels of vertex first (unless it is
   -1) and of the n vertices in rest. */
static int append_bag(PyObject *bags, PyObject **labels, int first, const int *rest, Py_ssize_t n) {
    Py_ssize_t lead = first >= 0 ? 1 : 0;
    PyObject *members = PyTuple_New(n + lead);
    if (!members) return -1;
    if (lead) {
        Py_INCREF(labels[first]);
        PyTuple_SET_ITEM(members, 0, labels[first]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(labels[rest[i]]);
        PyTuple_SET_ITEM(members, i + lead, labels[rest[i]]);
    }
    PyObject *bag = PyFrozenSet_New(members);
    Py_DECREF(members);
    if (!bag) return -1;
    int failed = PyList_Append(bags, bag);
    Py_DECREF(bag);
    return failed;
}

static PyObject *build_decomposition(PyObject *self, PyObject *args) {
    PyObject *nodes, *order_in, *higher, *tail_in;
    if (!PyArg_ParseTuple(args, "OOOO", &nodes, &order_in, &higher, &tail_in)) return NULL;
    PyObject *nodes_f = NULL, *order_f = NULL, *tail_f = NULL, *higher_f = NULL;
    PyObject *bags = NULL, *edges = NULL, *result = NULL;
    int *pos = NULL, *order = NULL, *tail = NULL, *hlen = NULL, *node_of = NULL, *absorbed = NULL;
    int *parent = NULL, *buf = NULL, *roots = NULL;
    char *in_tail = NULL;
    nodes_f = PySequence_Fast(nodes, "nodes must be a sequence");
    order_f = nodes_f ? PySequence_Fast(order_in, "order must be a sequence") : NULL;
    tail_f = order_f ? PySequence_Fast(tail_in, "tail must be a sequence") : NULL;
    higher_f = tail_f ? PySequence_Fast(higher, "higher must be a sequence") : NULL;
    if (!higher_f) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(nodes_f);
    Py_ssize_t no = PySequence_Fast_GET_SIZE(order_f), nt = PySequence_Fast_GET_SIZE(tail_f);
    bags = PyList_New(0);
    edges = PyList_New(0);
    if (!bags || !edges) goto done;
    if (n == 0) goto pack;
    if (PySequence_Fast_GET_SIZE(higher_f) != n || no > n || nt > n) {
        PyErr_SetString(PyExc_ValueError, "higher must have one entry per vertex, order and tail at most n");
        goto done;
    }
    size_t m = (size_t)n;
    pos = malloc(m * sizeof(int));
    order = malloc(m * sizeof(int));
    tail = malloc(m * sizeof(int));
    hlen = calloc(m, sizeof(int));
    node_of = malloc(m * sizeof(int));
    absorbed = malloc(m * sizeof(int));
    parent = malloc(m * sizeof(int));
    buf = malloc(m * sizeof(int));
    roots = malloc(m * sizeof(int));
    in_tail = calloc(m, 1);
    if (!pos || !order || !tail || !hlen || !node_of || !absorbed || !parent || !buf || !roots || !in_tail) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_ints(order_f, order, no, n) < 0 || read_ints(tail_f, tail, nt, n) < 0) goto done;
    for (Py_ssize_t v = 0; v < n; v++) {
        node_of[v] = absorbed[v] = parent[v] = -1;
        pos[v] = 0;
    }
    for (Py_ssize_t k = 0; k < no; k++) pos[order[k]] = (int)k;
    for (Py_ssize_t k = 0; k < nt; k++) {
        pos[tail[k]] = (int)no;
        in_tail[tail[k]] = 1;
    }
    PyObject **labels = PySequence_Fast_ITEMS(nodes_f);
    PyObject **highs = PySequence_Fast_ITEMS(higher_f);
    for (Py_ssize_t k = 0; k < no; k++) {
        Py_ssize_t len = PyObject_Size(highs[order[k]]);
        if (len < 0) goto done;
        hlen[order[k]] = (int)len;
    }
    int tail_absorber = -1, nroots = 0;
    for (Py_ssize_t k = 0; k < no; k++) {
        int v = order[k];
        PyObject *H = PySequence_Fast(highs[v], "higher[v] must be a sequence");
        if (!H) goto done;
        Py_ssize_t h = PySequence_Fast_GET_SIZE(H);
        int bad = read_ints(H, buf, h, n);
        Py_DECREF(H);
        if (bad < 0) goto done;
        int node = absorbed[v];
        if (node < 0) {
            node = (int)PyList_GET_SIZE(bags);
            if (append_bag(bags, labels, v, buf, h) < 0) goto done;
        }
        node_of[v] = node;
        if (h > 0) {
            int p = buf[0]; /* earliest eliminated of H; the first one on ties, as Python's min */
            for (Py_ssize_t i = 1; i < h; i++) {
                if (pos[buf[i]] < pos[p]) p = buf[i];
            }
            parent[v] = p;
            if (in_tail[p]) {
                if (tail_absorber < 0 && h == nt) tail_absorber = node;
            } else if (absorbed[p] < 0 && h == hlen[p] + 1) {
                absorbed[p] = node;
            }
        } else {
            roots[nroots++] = v;
        }
    }
    int tail_node = -1;
    if (nt > 0) {
        tail_node = tail_absorber;
        if (tail_node < 0) {
            tail_node = (int)PyList_GET_SIZE(bags);
            if (append_bag(bags, labels, -1, tail, nt) < 0) goto done;
        }
        for (Py_ssize_t i = 0; i < nt; i++) node_of[tail[i]] = tail_node;
    }
    for (Py_ssize_t k = 0; k < no; k++) {
        int v = order[k], p = parent[v];
        if (p >= 0 && node_of[v] != node_of[p]) {
            PyObject *e = Py_BuildValue("(ii)", node_of[p], node_of[v]);
            if (!e || PyList_Append(edges, e) < 0) {
                Py_XDECREF(e);
                goto done;
            }
            Py_DECREF(e);
        }
    }
    /* chain the roots of the components (the tail's bag first) into one tree */
    int first = tail_node >= 0 ? tail_node : (nroots > 0 ? node_of[roots[0]] : -1);
    for (int i = tail_node >= 0 ? 0 : 1; i < nroots; i++) {
        PyObject *e = Py_BuildValue("(ii)", first, node_of[roots[i]]);
        if (!e || PyList_Append(edges, e) < 0) {
            Py_XDECREF(e);
            goto done;
        }
        Py_DECREF(e);
    }
pack:
    result = PyTuple_Pack(2, bags, edges);
done:
    Py_XDECREF(nodes_f);
    Py_XDECREF(order_f);
    Py_XDECREF(tail_f);
    Py_XDECREF(higher_f);
    Py_XDECREF(bags);
    Py_XDECREF(edges);
    free(pos);
    free(order);
    free(tail);
    free(hlen);
    free(node_of);
    free(absorbed);
    free(parent);
    free(buf);
    free(roots);
    free(in_tail);
    return result;
}

static PyMethodDef methods[] = {
    {"min_fill", min_fill, METH_VARARGS, min_fill_doc},
    {"build_decomposition", build_decomposition, METH_VARARGS, build_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_compiled",
    "Compiled inner loops of treedecomp (optional; the Python code is the reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__compiled(void) { return PyModule_Create(&module); }
