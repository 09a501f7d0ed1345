/*
 * Received messages come from a freelist, as CPython's own tuples do:
 * a Message (sbus.client.protocol.Message, a NamedTuple: a heap tuple
 * subclass of two items, no __dict__, no weakrefs, no __del__) whose
 * items are bytes goes back to it when freed, kept alive (its refcount
 * set to 1, as a finalizer resurrects) with the reference to its type
 * that every instance of a heap type holds. Allocating and freeing one
 * through the type's generic slots costs more than making its payload.
 *
 * Contract: sbus_free_install returns 1 if the freelist serves `type`
 * (installed now or before), 0 otherwise; sbus_pair_new returns a new
 * reference (NULL with an exception set), its two items NULL, untracked by
 * the GC. Single-threaded: the GIL is held.
 */
#ifndef SBUS_MESSAGE_FREELIST_H
#define SBUS_MESSAGE_FREELIST_H

#include <Python.h>

#define SBUS_FREE_MAX 1024
static PyTypeObject *sbus_free_type = NULL;
static PyObject *sbus_free[SBUS_FREE_MAX];
static int sbus_nfree = 0;

static void sbus_message_dealloc(PyObject *op) {
    PyTypeObject *tp = Py_TYPE(op);
    PyObject *key, *payload;
    Py_ssize_t i;
    PyObject_GC_UnTrack(op);
    if (tp == sbus_free_type && sbus_nfree < SBUS_FREE_MAX && Py_SIZE(op) == 2) {
        key = PyTuple_GET_ITEM(op, 0);
        payload = PyTuple_GET_ITEM(op, 1);
        if (key != NULL && payload != NULL && PyBytes_CheckExact(key)
                && PyBytes_CheckExact(payload)) {
            PyTuple_SET_ITEM(op, 0, NULL);
            PyTuple_SET_ITEM(op, 1, NULL);
            Py_DECREF(key);         /* bytes: no Python code runs */
            Py_DECREF(payload);
            Py_SET_REFCNT(op, 1);
            sbus_free[sbus_nfree++] = op;
            return;
        }
    }
    /* What tuple's dealloc does for a subclass, then the type reference:
       subtype_dealloc leaves that to a base that is a heap type (this
       one, for an instance of a subclass of Message). */
    Py_TRASHCAN_BEGIN(op, sbus_message_dealloc)
    for (i = Py_SIZE(op); --i >= 0;)
        Py_XDECREF(PyTuple_GET_ITEM(op, i));
    tp->tp_free(op);
    Py_DECREF(tp);
    Py_TRASHCAN_END
}

/* Install the freelist on `type` if it is laid out as Message is; 1 if it is. */
static int sbus_free_install(PyTypeObject *type) {
    if (sbus_free_type != NULL)
        return type == sbus_free_type;
    if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) || type->tp_base != &PyTuple_Type
            || type->tp_basicsize != PyTuple_Type.tp_basicsize
            || type->tp_itemsize != PyTuple_Type.tp_itemsize
            || type->tp_dictoffset != 0 || type->tp_weaklistoffset != 0
            || type->tp_finalize != NULL || type->tp_del != NULL)
        return 0;
    Py_INCREF(type);
    sbus_free_type = type;
    type->tp_dealloc = sbus_message_dealloc;
    return 1;
}

/* A new two-item instance of `type`, untracked by the GC, items NULL. */
static PyObject *sbus_pair_new(PyTypeObject *type) {
    PyObject *op;
    if (type == sbus_free_type && sbus_nfree > 0)
        return sbus_free[--sbus_nfree];
    op = type->tp_alloc(type, 2);
    if (op != NULL)
        PyObject_GC_UnTrack(op);   /* else a long queue is traversed by every young-generation collection */
    return op;
}

#endif
