from django.urls import include, path
from rest_framework.routers import DefaultRouter

from jobs import api, api_auth, api_calibration, api_code, api_knowledge, api_plan, views, views_knowledge, views_relay

router = DefaultRouter()
router.register("jobs", api.JobViewSet, basename="api-job")
router.register("nodes", api.NodeViewSet, basename="api-node")

urlpatterns = [
    path("", views.overview, name="overview"),
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/new/", views.job_new, name="job-new"),
    path("jobs/<int:pk>/", views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job-cancel"),
    path("nodes/", views.node_list, name="node-list"),
    path("nodes/control-plane/", views.control_plane, name="control-plane"),
    path("quotas/", views.quota_list, name="quota-list"),
    path("knowledge/", views_knowledge.knowledge_page, name="knowledge"),
    path("relay/dead-letters/", views_relay.dead_letters, name="relay-dead-letters"),
    path("api/v1/auth/token/", api_auth.AuthTokenView.as_view(), name="api-auth-token"),
    path("api/v1/quotas/", api.QuotaView.as_view(), name="api-quotas"),
    path("api/v1/knowledge/", api_knowledge.KnowledgeView.as_view(), name="api-knowledge"),
    path("api/v1/code/", api_code.CodeUploadView.as_view(), name="api-code"),
    path("api/v1/plan/", api_plan.PlanView.as_view(), name="api-plan"),
    path("api/v1/code/<str:digest>/", api_code.CodeDetailView.as_view(), name="api-code-detail"),
    path("api/v1/calibrations/", api_calibration.CalibrationView.as_view(), name="api-calibrations"),
    path("api/v1/", include(router.urls)),
]
